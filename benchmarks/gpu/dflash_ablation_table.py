"""The tables of benchmarks/gpu/dflash_ablation.sh, from its work directory: each run's held-out acceptance by block
slot and replayed block tau (its final eval), the base run's held-out tau against training tokens, and both drafters'
training rate from benchmarks.train. Prints Markdown; stdlib only, so it runs wherever the runs ran.

    python benchmarks/gpu/dflash_ablation_table.py /root/abl
"""
import json
import statistics
import sys
from pathlib import Path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train_rate(recs: list[dict]) -> float:
    """Median train tokens/s over the run's second half (its first holds the compile)."""
    rates = [r["tokens_per_s"] for r in recs if r.get("split") == "train" and "tokens_per_s" in r]
    return statistics.median(rates[len(rates) // 2:]) if rates else float("nan")


def tau_of(ev: dict) -> str:
    if "round_tau_by_chain" not in ev:
        return "-"
    return f"{ev['round_tau_by_chain'][-1]:.2f} ({ev['round_tau_first_by_chain'][-1]:.2f})"


def main(abl: Path) -> None:
    rates = {m: json.loads((abl / f"rate-{m}.json").read_text()) for m in ("eagle3", "dflash")
             if (abl / f"rate-{m}.json").exists()}
    if rates:
        print("| drafter (random features, the epochs after the first) | ms/step | tokens/s | peak GiB |")
        print("|---|---|---|---|")
        for m, doc in rates.items():
            for r in doc["rows"]:
                if "error" in r:
                    print(f"| {m} | {r['error']} | | |")
                else:
                    print(f"| {m} ({r['shape']}, {r['seq']} x {r['rows']}) | {r['ms_step']:.1f} | {r['tok_s']:,.0f} "
                          f"| {r['peak_gib']:.1f} |")
        ok = [d["rows"][0] for d in rates.values() if d["rows"] and "error" not in d["rows"][0]]
        if len(ok) == 2:
            print(f"\nDFlash takes {ok[1]['ms_step'] / ok[0]['ms_step']:.2f}x EAGLE-3's time per step on the same "
                  "rows.\n")
    runs = [line.split("|") for line in (abl / "runs.txt").read_text().splitlines()] \
        if (abl / "runs.txt").exists() else []
    if runs:
        print("| run | flags | exit | wall s | train tok/s (first epoch: the target runs) | held-out acc by slot 1-8 "
              "| replayed tau (first replies) |")
        print("|---|---|---|---|---|---|---|")
    curve: list[dict] = []
    for name, flags, rc, wall in runs:
        recs = records(abl / name / "metrics.jsonl")
        evals = [r for r in recs if r.get("split") == "eval"]
        if name == "base":
            curve = evals
        ev = evals[-1] if evals else {}
        acc = " ".join(f"{a:.3f}" for a in ev.get("acc_k", [])[:8]) or "-"
        print(f"| {name} | `{flags or '(the recipe)'}` | {rc} | {wall} | {train_rate(recs):,.0f} | {acc} "
              f"| {tau_of(ev)} |")
    benches = {gr: json.loads((abl / f"bench-{gr}.json").read_text()) for gr in ("graph-round", "no-graph-round")
               if (abl / f"bench-{gr}.json").exists()}
    if benches:
        print("\n| base drafter's bench | method | tau | tok/s | speedup vs plain (same process) |")
        print("|---|---|---|---|---|")
        for gr, rep in benches.items():
            for m, r in rep["methods"].items():
                print(f"| {gr} | {m} | {r['tau']:.2f} | {r['tokens_per_s'] or 0:,.0f} | {r.get('speedup', 1.0):.2f} |")
    if len(curve) > 1:
        print("\nThe base run's held-out evals along its steps:\n")
        print("| step | tokens seen | acc slot 1 | replayed tau (first replies) |")
        print("|---|---|---|---|")
        for r in curve:
            print(f"| {r['step']} | {r['tokens_seen']:,} | {r['acc_k'][0]:.3f} | {tau_of(r)} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
