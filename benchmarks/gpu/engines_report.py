"""Tables of a live engine run (benchmarks/gpu/engines_live.sh), appended to BENCHMARKS.md.

    python -m benchmarks.gpu.engines_report --results DIR [--note TEXT] [--machine TEXT] [--md FILE]

DIR holds ENGINE/engine-CONFIG-PROMPTS.json (`eyas bench --engine` reports: a drafter's server against a plain
server of the same target) and sglang/inproc-CONFIG-PROMPTS.json (`eyas bench` in process on the same prompts and
drafter), CONFIG being dflash or chain. One row per engine, drafter and prompt set: output tok/s of both servers and
their ratio, tau from the engine's counters beside the in-process tau and their difference, the turns whose greedy
replies equal the plain server's (with the divergences' plain-server margins where they differ), and acceptance by
draft position in both. The section goes to BENCHMARKS.md through benchmarks.record (--md FILE, --no-record); its
machine is the one the job ran on (--machine), not the one making the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import record

CONFIGS = {"dflash": "DFlash", "chain": "EAGLE-3 chain"}
SETS = ("sharegpt-heldout", "humaneval")


def _method(report: dict) -> dict:
    """The drafter's method of a bench report (the one that is not plain or a baseline)."""
    return next(v for k, v in report["methods"].items() if k.startswith(("dflash", "eagle")))


def _positions(m: dict, n: int = 6) -> str:
    acc = m.get("acceptance_by_position") or []
    return " ".join(f"{a:.2f}" for a in acc[:n]) + (" ..." if len(acc) > n else "")


def _divergences(report: dict) -> str:
    """The plain server's margins (log-probability of its token less the drafted one's) at the first differing
    token of each differing turn: small margins are near-ties of the dtype, not a lossless bug."""
    agree = next(iter(report.get("agreement", {}).values()), {})
    div = agree.get("divergences") or []
    margins = [d.get("margin") for d in div if isinstance(d, dict) and d.get("margin") is not None]
    return ", ".join(f"{x:.3f}" for x in sorted(margins)) if margins else ""


def rows(results: Path) -> list[str]:
    out = ["| engine | drafter | prompts | plain tok/s | drafter tok/s | speedup | tau (engine) | tau (in process) | "
           "engine vs in process | turns equal to plain | margins where not | acceptance by position (engine) | "
           "(in process) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for engine in ("sglang", "vllm"):
        for config, label in CONFIGS.items():
            for ps in SETS:
                f = results / engine / f"engine-{config}-{ps}.json"
                if not f.exists():
                    continue
                r = json.loads(f.read_text())
                plain, spec = r["methods"].get("plain", {}), _method(r)
                ref_file = results / "sglang" / f"inproc-{config}-{ps}.json"
                ref = _method(json.loads(ref_file.read_text())) if ref_file.exists() else None
                agree = next(iter(r.get("agreement", {}).values()), {})
                diff = f"{100 * (spec['tau'] / ref['tau'] - 1):+.1f}%" if ref else ""
                ref_tau = "" if ref is None else f"{ref['tau']:.3f}"
                out.append(
                    f"| {engine} {r['engine']['spec'].get('version', '')} | {label} | {ps} ({r['records']}) | "
                    f"{plain.get('tokens_per_s', '')} | {spec.get('tokens_per_s')} | {spec.get('speedup', '')}x | "
                    f"{spec['tau']:.3f} | {ref_tau} | {diff} | "
                    f"{agree.get('identical_turns', '')}/{agree.get('turns', '')} | {_divergences(r)} | "
                    f"{_positions(spec)} | {'' if ref is None else _positions(ref)} |")
    return out if len(out) > 2 else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="the folder holding the sglang/ and vllm/ result folders")
    ap.add_argument("--title", default="Live engines: eyas drafters served by SGLang and vLLM")
    ap.add_argument("--note", action="append", default=[], help="a line added under the table (what ran, caveats)")
    ap.add_argument("--machine", default="the lent GPU machine", help="where the job ran (the section's machine)")
    record.add_options(ap)
    args = ap.parse_args()
    table = rows(Path(args.results))
    if not table:
        sys.exit(f"{args.results}: no sglang/ or vllm/ folder with engine-*.json")
    print(record.write(args, args.title, "\n".join(table), command=record.command_line(__spec__.name),
                       machine=args.machine, details=args.note, measured_here=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
