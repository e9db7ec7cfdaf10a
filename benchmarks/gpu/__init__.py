"""The lent GPU machine's staging scripts (README.md here) and the two tools their live engine jobs run:
engine_measure (a served drafter's tok/s and accept length) and engines_report (those results as tables)."""
