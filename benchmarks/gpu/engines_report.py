"""Tables of a live engine run (benchmarks/gpu/engines_live.sh), appended to BENCHMARKS.md (issue 13).

    python -m benchmarks.gpu.engines_report --results DIR [--bench NAME=BENCH.json ...] [--note TEXT] [--md FILE]

DIR holds ENGINE/spec-CONFIG-PROMPTS-bsB.json (engine_measure.py's lines) for sglang and/or vllm. Each engine gets
one row per prompt set and batch: output tok/s without a drafter and with the EAGLE-3 chain, the speedup, the
engine's accept length (its own convention: tokens per verify step) and tau in eyas's unit (tokens per target
forward, the prefill counted). `--bench PROMPTS=FILE` adds `eyas bench` JSONs run on the same batch-1 prompts:
their tau and the engine's difference from it. The section goes to BENCHMARKS.md through benchmarks.record (--md
FILE, --no-record); its machine is the one the job ran on (--machine), not the one making the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import record


def rows(results: Path, bench: dict[str, float]) -> list[str]:
    out = []
    for engine in ("sglang", "vllm"):
        d = results / engine
        if not d.is_dir():
            continue
        out += [f"### {engine}", "",
                "| prompts | batch | plain tok/s | chain tok/s | speedup | accept length | tau (eyas unit) | "
                "eyas bench tau | engine vs bench |", "|---|---|---|---|---|---|---|---|---|"]
        for ps in ("sharegpt-heldout", "humaneval"):
            for bs in (1, 16):
                p, c = d / f"spec-plain-{ps}-bs{bs}.json", d / f"spec-chain-{ps}-bs{bs}.json"
                if not (p.exists() and c.exists()):
                    continue
                p, c = json.loads(p.read_text()), json.loads(c.read_text())
                tau = c.get("tau")
                ref = bench.get(ps) if bs == 1 else None
                diff = f"{100 * (tau / ref - 1):+.1f}%" if tau and ref else ""
                out.append(f"| {ps} ({c['requests']}) | {bs} | {p['output_tok_s']:.0f} | {c['output_tok_s']:.0f} | "
                           f"{c['output_tok_s'] / p['output_tok_s']:.2f}x | {c['accept_length']} | {tau} | "
                           f"{'' if ref is None else f'{ref:.3f}'} | {diff} |")
        out.append("")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="the folder holding sglang/ and vllm/ result folders")
    ap.add_argument("--bench", action="append", default=[], help="PROMPTS=eyas bench JSON on the same prompts")
    ap.add_argument("--title", default="Live engines: an eyas drafter served by SGLang and vLLM")
    ap.add_argument("--note", action="append", default=[], help="a line added under the table (what ran, caveats)")
    ap.add_argument("--machine", default="the lent GPU machine", help="where the job ran (the section's machine)")
    record.add_options(ap)
    args = ap.parse_args()
    bench = {}
    for item in args.bench:
        name, _, path = item.partition("=")
        r = json.loads(Path(path).read_text())
        m = next(v for k, v in r["methods"].items() if k.startswith("eagle"))
        bench[name] = float(m["tau"])
    table = rows(Path(args.results), bench)
    if not table:
        sys.exit(f"{args.results}: no sglang/ or vllm/ folder with spec-*.json")
    print(record.write(args, args.title, "\n".join(table), command=record.command_line(__spec__.name),
                       machine=args.machine, details=args.note, measured_here=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
