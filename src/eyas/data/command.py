"""`eyas prepare`: argument parsing only; the work is eyas.data.prepare.run_prepare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import eyas.data.prepare  # run_prepare looked up at call time: tests patch it
from eyas.data.prepare import PrepareConfig, format_counts, skipped_lines
from eyas.errors import EyasError
from eyas.knobs import (DEVICE_HELP, add_command, add_flags, announce_target, flag_or_default, from_args, knobs,
                        resolve_device)

# The --help sections and the PrepareConfig fields in each; a field left out of every one still gets its flag, under
# "other settings", so a new field never goes without one.
GROUPS = {
    "target": ["target", "device", "trust_remote_code"],
    "data": ["data", "limit", "max_len", "max_turns", "heldout_fraction"],
    "regeneration (--regenerate: the target writes the replies)": [
        "regenerate", "regenerate_limit", "regen_temperature", "samples_per_prompt", "greedy_sample", "self_prompts",
        "self_prompt_temperature", "max_new_tokens", "seed", "batch_size", "gen_batch", "regen_dtype", "regen_compile",
        "regen_fuse"],
    "regeneration server (--server: an OpenAI-compatible server writes the replies)": [
        "server", "model", "concurrency", "timeout", "retries"],
    "output": ["out", "overwrite"],
}


def register(subparsers) -> argparse.ArgumentParser:
    p = add_command(subparsers, "prepare", main, help="tokenize conversations with loss masks (train split only)")
    special = dict(regen_temperature={"flags": ("--regen-temperature", "--temperature")},
                   regen_dtype={"choices": ["fp32", "bf16", "fp16"]},
                   device={"default": "auto", "help": DEVICE_HELP + "; local regeneration runs the target there "
                                                                     "(default: %(default)s)"})
    groups = {title: p.add_argument_group(title) for title in GROUPS}
    for title, names in GROUPS.items():
        add_flags(groups[title], PrepareConfig, names, **special)
    grouped = {n for names in GROUPS.values() for n in names}
    if rest := [n for n in knobs(PrepareConfig) if n not in grouped]:
        add_flags(p.add_argument_group("other settings"), PrepareConfig, rest, **special)
    groups["output"].add_argument("--verbose", action="store_true", help="print every skipped record and dropped "
                                  "sample (always written to OUT/skipped.jsonl)")
    return p


def main(args: argparse.Namespace) -> int:
    """Tokenize conversations with the target's chat template and assistant loss masks; writes the TRAIN split
    (held-out ids are skipped) and manifest.json. Rerunning the same command resumes an interrupted run."""
    try:
        cfg = from_args(PrepareConfig, args, device=resolve_device(args.device))
    except ValueError as e:
        raise EyasError(str(e)) from e
    announce_target("prepare", cfg.target, flag_or_default(cfg.target, PrepareConfig.target))
    manifest = eyas.data.prepare.run_prepare(cfg)
    print(f"prepared {cfg.out}")
    print(format_counts(manifest["counts"]))
    skips = Path(cfg.out) / "skipped.jsonl"
    if args.verbose and skips.exists():
        for line in skipped_lines(skips):
            print(line, file=sys.stderr)
    return 0
