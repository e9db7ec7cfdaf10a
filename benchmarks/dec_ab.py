"""Before/after table of `eyas bench` JSONs (benchmarks/dec_ab.sh): per bench and method, tau, tokens, tok/s of
each run, and whether the after tree decoded exactly what the before tree did (per-record tokens and rounds, and the
per-turn agreement with plain, equal in every run).

    python benchmarks/dec_ab.py DIR [--before-rev REV] [--after-rev REV] [--md FILE]

DIR holds {before,after}-{bench}-{run}.json, e.g. before-chain5-1.json; missing files are reported as missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path


def load(d: Path) -> dict:
    """{(bench, tree): [report per run, in run order]} from DIR's files."""
    runs: dict = {}
    for p in sorted(d.glob("*.json")):
        m = re.fullmatch(r"(before|after)-(.+)-(\d+)\.json", p.name)
        if m:
            runs.setdefault((m[2], m[1]), []).append(json.loads(p.read_text()))
    return runs


def decoded(report: dict, method: str) -> tuple:
    """What a method decoded, as far as the report tells: per-record (tokens, rounds) and its agreement with plain."""
    m = report["methods"][method]
    return (json.dumps(m.get("per_record")), json.dumps((report.get("agreement") or {}).get(method)))


def table(runs: dict) -> list[str]:
    lines = ["| bench | method | tau before | tau after | tokens before | tokens after | tok/s before (runs) "
             "| tok/s after (runs) | after / before | identical decoding |", "|---|---|---|---|---|---|---|---|---|---|"]
    for bench in sorted({b for b, _ in runs}):
        before, after = runs.get((bench, "before"), []), runs.get((bench, "after"), [])
        if not before or not after:
            lines.append(f"| {bench} | missing: {len(before)} before, {len(after)} after run(s) | | | | | | | | |")
            continue
        for method in before[0]["methods"]:
            if not all(method in r["methods"] for r in before + after):
                lines.append(f"| {bench} | {method}: not in every run | | | | | | | | |")
                continue
            b, a = before[0]["methods"][method], after[0]["methods"][method]
            rate = lambda rs: [r["methods"][method]["tokens_per_s"] for r in rs]  # noqa: E731
            rb, ra = rate(before), rate(after)
            same = len({decoded(r, method) for r in before + after}) == 1
            lines.append(f"| {bench} | {method} | {b['tau']:.3f} | {a['tau']:.3f} | {b['tokens']} | {a['tokens']} | "
                         f"{', '.join(f'{x:,.0f}' for x in rb)} | {', '.join(f'{x:,.0f}' for x in ra)} | "
                         f"{(sum(ra) / len(ra)) / (sum(rb) / len(rb)):.3f} | {'yes' if same else 'NO'} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--before-rev", default="")
    ap.add_argument("--after-rev", default="")
    ap.add_argument("--md", default="", help="append the section to this file (default: print only)")
    args = ap.parse_args()
    runs = load(Path(args.dir))
    if not runs:
        print(f"{args.dir}: no before-*/after-* bench JSONs", file=sys.stderr)
        return 1
    any_report = next(iter(runs.values()))[0]
    head = [f"## decode/ before and after (issue 34) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
            f"Machine: {any_report.get('device', '?')} on {platform.node() or '?'}; before {args.before_rev or '?'}, "
            f"after {args.after_rev or '?'}; dtype {any_report.get('dtype')}. Command: `bash benchmarks/dec_ab.sh job` "
            "(each bench an `eyas bench --compile` process, trees alternating).", ""]
    text = "\n".join(head + table(runs)) + "\n"
    print(text)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
