"""`eyas prepare`: argument parsing only; the work is eyas.data.prepare.run_prepare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyas.errors import EyasError
from eyas.knobs import add_flags, from_args


def register(subparsers) -> argparse.ArgumentParser:
    from eyas.data.prepare import PrepareConfig

    p = subparsers.add_parser(
        "prepare", help="tokenize conversations with loss masks (train split only)",
        description="Tokenize conversations with the target's chat template and assistant loss masks; "
                    "writes the TRAIN split (held-out ids are skipped) and manifest.json. "
                    "Rerunning the same command resumes an interrupted run.")
    add_flags(p, PrepareConfig, regen_temperature={"flags": ("--regen-temperature", "--temperature")},
              regen_dtype={"choices": ["fp32", "bf16", "fp16"]})
    p.add_argument("--verbose", action="store_true", help="print every skipped record and dropped sample "
                   "(always written to OUT/skipped.jsonl)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from eyas.data.prepare import PrepareConfig, format_counts, run_prepare, skipped_lines

    try:
        cfg = from_args(PrepareConfig, args)
    except ValueError as e:
        raise EyasError(str(e)) from e
    manifest = run_prepare(cfg)
    print(f"prepared {cfg.out}")
    print(format_counts(manifest["counts"]))
    skips = Path(cfg.out) / "skipped.jsonl"
    if args.verbose and skips.exists():
        for line in skipped_lines(skips):
            print(line, file=sys.stderr)
    return 0
