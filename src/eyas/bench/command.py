"""`eyas bench` command line: parses arguments and calls run_bench.

Everything that needs no target is checked before one loads (the counts, --drafter, --prompts, the device), so a typo
fails in milliseconds rather than after a model load. Without --target the bench runs the target the drafter was
trained for, read from what its directories record."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import eyas.target  # load_target looked up at call time: tests patch it
from eyas.bench.bench import BenchConfig, PROMPT_SETS, graph_round_default, run_bench
from eyas.bench.engine import ENGINES, EngineBenchConfig, run_engine_bench
from eyas.data.prompts import load_prompts
from eyas.data.sources import resolve_data
from eyas.errors import EyasError
from eyas.knobs import (DEVICE_HELP, FROM_DRAFTER, FROM_FLAG, add_command, add_flags, announce_target, default_source,
                        flag_name, from_args, resolve_device)
from eyas.manifest import MANIFEST, atomic_write_bytes, read_manifest
from eyas.model.checkpoint import drafter_dir, open_drafter
from eyas.target.load import EMBEDDED


# Flags that are not a BenchConfig field: --chain K | --tree set method and k together, --graph-round resolves
# its default (on for greedy chains and trees on CUDA; the bench turns it off for a DFlash drafter) into
# spec.graph_round; the mismatch override is handled here, where the drafter is opened.
NOT_FIELDS = ("chain", "tree", "one_graph_round", "allow_target_mismatch")

COUNTS = ("chain", "top_k", "depth", "total_tokens", "max_new_tokens", "limit", "max_turns", "max_prompt_tokens",
          "min_prompt_tokens", "max_seq", "concurrency")
"""Flags that take a count of at least 1 (None where a flag is left out: its default)."""


def register(subparsers) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench", main, help="measure acceptance length and real speedup of a drafter")
    special = dict(target={"default": None, "help": "target model: embedded name, HF directory, hub id or GGUF path "
                                                    "(default: the target the drafter was trained for, as its run "
                                                    "records it; without --drafter the embedded SmolLM2-135M-Instruct)"},
                   device={"default": "auto", "help": DEVICE_HELP + " (default: %(default)s)"},
                   dtype={"choices": ["fp32", "bf16", "fp16"]},
                   baselines={"help": "skip plain decoding and prompt lookup"},
                   lossless_turns={"metavar": "N"},
                   json_out={"flags": ("--json",)})
    target = p.add_argument_group("target")
    add_flags(target, BenchConfig, ["target", "device", "dtype", "compile", "persist_steps", "trust_remote_code"],
              **special)
    target.add_argument("--allow-target-mismatch", action="store_true",
                        help="bench a drafter whose recorded target fingerprint differs from --target's (a warning, "
                             "kept in the report)")
    decoding = p.add_argument_group("drafter and decoding")
    add_flags(decoding, BenchConfig, ["drafter"], **special)
    shape = decoding.add_mutually_exclusive_group()
    shape.add_argument("--chain", type=int, metavar="K",
                       help="chain of K draft tokens (default 5; a DFlash drafter of block B: B-1, at most B-1)")
    shape.add_argument("--tree", action="store_true", help="EAGLE-2 dynamic tree")
    decoding.add_argument("--graph-round", action=argparse.BooleanOptionalAction, default=None,
                          dest="one_graph_round",
                          help="greedy chains and trees: run each whole round on the device, one CUDA graph on CUDA "
                               "(default: on for greedy chains and trees on CUDA, off otherwise)")
    add_flags(decoding, BenchConfig, ["top_k", "depth", "total_tokens", "temperature", "top_p", "seed"], **special)
    add_flags(p.add_argument_group("prompts"), BenchConfig, ["prompts", "limit", "max_turns", "max_prompt_tokens",
                                                            "min_prompt_tokens", "max_new_tokens", "max_seq"],
              **special)
    add_flags(p.add_argument_group("output"), BenchConfig, ["baselines", "lossless_turns", "json_out"], **special)
    served = p.add_argument_group("in a serving engine (--engine): the target and drafter are served, --target is "
                                  "the served model's directory (config and tokenizer, no weights)")
    # --trust-remote-code (above) reaches EngineBenchConfig too: from_args reads it by its field name
    add_flags(served, EngineBenchConfig, ["engine", "url", "plain_url", "model", "request_timeout", "concurrency",
                                          "drafter_kind"],
              drafter_kind={"choices": ["eagle3", "dflash"]},
              engine={"default": None, "required": False, "choices": ENGINES,
                      "help": "bench the drafter served by this engine at --url, from the engine's own counters"},
              url={"default": None, "required": False})
    return p


def check_counts(args: argparse.Namespace) -> None:
    """Refuse a count flag below 1 (and --lossless-turns below 0) in one line, before anything loads: --chain 0
    must not mean the default chain."""
    for name in COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise EyasError(f"{flag_name(name)} {value}: expected a count of at least 1")
    if getattr(args, "lossless_turns", 0) < 0:
        raise EyasError(f"--lossless-turns {args.lossless_turns}: expected 0 (off) or more turns")


def bench_config(args: argparse.Namespace, device: str, *, target: str | None = None):
    """The BenchConfig of parsed `eyas bench` flags on `device` (--chain/--tree and --graph-round resolved) and
    `target` (default: --target, else BenchConfig's)."""
    shape = {"method": "tree"} if args.tree else {"method": "chain",
                                                  **({"k": args.chain} if args.chain is not None else {})}
    graph_round = args.one_graph_round
    if graph_round is None:
        graph_round = graph_round_default(device, args.temperature)
    if graph_round:
        shape["graph_round"] = True
    return from_args(BenchConfig, args, **shape, device=device, target=target or args.target or BenchConfig.target)


def loads_as_named(spec: str) -> bool:
    """Whether a recorded target name loads as it is: an embedded name, a path that exists here, or a hub id."""
    return spec in EMBEDDED or Path(spec).expanduser().exists() or (spec.count("/") == 1 and
                                                                    not spec.startswith((".", "/", "~")))


def recorded_fingerprint(drafter: str) -> tuple[Path, dict | None]:
    """(the directory holding the drafter's config.json, the target fingerprint it records or None), no weights read.
    Refuses a path that holds no drafter."""
    d = drafter_dir(drafter)
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise EyasError(f"{d / 'config.json'}: cannot read the drafter's config ({e})") from None
    raw = raw if isinstance(raw, dict) else {}
    fingerprint = raw.get("target") or raw.get("eyas_target")   # an eyas drafter dir | an exported dir
    return d, fingerprint if isinstance(fingerprint, dict) else None


def recorded_target(drafter: str) -> str | None:
    """The target the drafter at `drafter` was trained for, from what its directories record (no weights read): the
    training run's --target, else the spec its store's capture loaded, else the name in the drafter's recorded
    fingerprint (an exported drafter keeps only that). The first of them that loads as it is; None when nothing is
    recorded (a published head). A recorded name that loads nowhere here is refused, saying to pass --target."""
    d, fingerprint = recorded_fingerprint(drafter)
    names = []
    if d.name == "drafter" and (d.parent / MANIFEST).is_file():   # a training run's drafter
        try:
            run = read_manifest(d.parent, kind="train")
            names.append(run["config"].get("target"))
            if store := (run.get("source") or {}).get("store"):
                names.append(read_manifest(store).get("config", {}).get("target"))
        except (EyasError, KeyError, AttributeError):
            pass   # not a run eyas can read: the drafter's own record below
    if fingerprint:
        names.append(fingerprint.get("identity"))
    names = [n for n in names if isinstance(n, str) and n]
    for name in names:
        if loads_as_named(name):
            return name
    if names:
        raise EyasError(f"{drafter}: the drafter was trained for target {names[0]!r}, a name that loads nothing "
                        f"here; pass --target with that model's directory, GGUF file or hub id")
    return None


def check_prompts(spec: str) -> None:
    """Refuse a --prompts that cannot load, before the target does: a named set's data file, a prompt file (its
    first record is read)."""
    if spec in PROMPT_SETS:
        return
    if spec.startswith(("heldout:", "long:")):
        resolve_data(spec.split(":", 1)[1])
        return
    if not load_prompts(spec, limit=1):
        raise EyasError(f"{spec}: no prompts")


def main(args: argparse.Namespace) -> int:
    """Speculative decoding benchmark with plain and prompt-lookup baselines: tokens per target forward (tau) and the
    speedup over plain decoding measured in the same run, and at temperature 0 a check that the outputs equal plain
    greedy decoding."""
    import torch

    check_counts(args)
    if getattr(args, "engine", None) or getattr(args, "url", None) or getattr(args, "plain_url", None):
        return engine_main(args)
    device = resolve_device(args.device)
    if args.target:
        if args.drafter:
            recorded_fingerprint(args.drafter)   # refuses a path that holds no drafter
        target, source = args.target, FROM_FLAG
    else:
        target = recorded_target(args.drafter) if args.drafter else None
        target, source = (target, FROM_DRAFTER) if target else (BenchConfig.target, default_source(BenchConfig.target))
    check_prompts(args.prompts)
    cfg = bench_config(args, device, target=target)
    announce_target("bench", cfg.target, source)
    if not args.allow_target_mismatch or not args.drafter:
        run_bench(cfg)
        return 0
    # The drafter is loaded here, accepting another target's fingerprint with a warning; run_bench gets both.
    import sys

    dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    target = eyas.target.load_target(cfg.target, device=cfg.device, dtype=dtype,
                                     trust_remote_code=cfg.trust_remote_code)
    drafter, meta = open_drafter(cfg.drafter, target, allow_target_mismatch=True)
    report = run_bench(cfg, target=target, drafter=drafter, drafter_meta=meta)
    if warning := meta.get("target_mismatch"):
        print(f"warning: {warning}", file=sys.stderr)
        report["target_mismatch"] = {"warning": warning, "trained_target": meta["trained_target"]}
        if cfg.json_out:
            written = {k: v for k, v in report.items() if k != "plot"}
            atomic_write_bytes(Path(cfg.json_out), (json.dumps(written, indent=2) + "\n").encode())
    return 0


def engine_main(args: argparse.Namespace) -> int:
    """`eyas bench --engine E --url URL [--plain-url URL2]`: nothing is loaded in process but the tokenizer."""
    if not args.engine:
        raise EyasError("--url and --plain-url bench a served drafter: say which engine serves it (--engine "
                        "sglang or vllm)")
    run_engine_bench(bench_config(args, "cpu"), from_args(EngineBenchConfig, args))
    return 0
