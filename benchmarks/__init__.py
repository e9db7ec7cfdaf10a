"""eyas's benchmark tools, one module each, run from the repository root as `python -m benchmarks.NAME` (README.md
here lists them). `record` is the one writer of BENCHMARKS.md sections; `gpu/` holds the lent GPU machine's
staging scripts. This file stays empty of imports: a tool's child processes import the package too."""
