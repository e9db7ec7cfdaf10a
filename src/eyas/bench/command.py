"""`eyas bench` command line: parses arguments and calls run_bench."""

from __future__ import annotations

import argparse

from eyas.knobs import add_flags, from_args


# Flags that are not a BenchConfig field: --chain K | --tree set method and k together, --graph-round resolves
# its default (on for greedy chains and trees on CUDA; the bench turns it off for a DFlash drafter) into
# spec.graph_round; the mismatch override is handled here, where the drafter is opened.
NOT_FIELDS = ("chain", "tree", "one_graph_round", "allow_target_mismatch")


def register(subparsers) -> argparse.ArgumentParser:
    from eyas.bench.bench import BenchConfig

    p = subparsers.add_parser("bench", help="measure acceptance length and real speedup of a drafter",
                              description="Speculative decoding benchmark with plain and prompt-lookup baselines.")
    add_flags(p, BenchConfig, ["target", "drafter", "prompts"])
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--chain", type=int, metavar="K",
                       help="chain of K draft tokens (default 5; a DFlash drafter of block B: B-1, at most B-1)")
    shape.add_argument("--tree", action="store_true", help="EAGLE-2 dynamic tree")
    p.add_argument("--graph-round", action=argparse.BooleanOptionalAction, default=None,
                   dest="one_graph_round",
                   help="greedy chains and trees: run each whole round on the device, one CUDA graph on CUDA "
                        "(default: on for greedy chains and trees on CUDA, off otherwise)")
    add_flags(p, BenchConfig, ["top_k", "depth", "total_tokens", "temperature", "top_p", "max_new_tokens", "limit",
                               "max_turns", "max_prompt_tokens", "min_prompt_tokens", "max_seq", "device", "dtype",
                               "compile", "persist_steps", "baselines", "lossless_turns", "seed", "json_out",
                               "trust_remote_code"],
              device={"default": None, "help": "cpu or cuda (default: cuda if available)"},
              dtype={"choices": ["fp32", "bf16", "fp16"]},
              baselines={"help": "skip plain decoding and prompt lookup"},
              lossless_turns={"metavar": "N"},
              json_out={"flags": ("--json",)})
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="bench a drafter whose recorded target fingerprint differs from --target's (a warning, "
                        "kept in the report's target_mismatch)")
    from eyas.bench.engine import ENGINES, EngineBenchConfig
    served = p.add_argument_group("in a serving engine (--engine): the target and drafter are served, --target is "
                                  "the served model's directory (config and tokenizer, no weights)")
    # --trust-remote-code (above) reaches EngineBenchConfig too: from_args reads it by its field name
    add_flags(served, EngineBenchConfig, ["engine", "url", "plain_url", "model", "request_timeout", "concurrency"],
              engine={"default": None, "required": False, "choices": ENGINES,
                      "help": "bench the drafter served by this engine at --url, from the engine's own counters"},
              url={"default": None, "required": False})
    p.set_defaults(func=main)
    return p


def bench_config(args: argparse.Namespace, device: str):
    """The BenchConfig of parsed `eyas bench` flags on `device` (--chain/--tree and --graph-round resolved)."""
    from eyas.bench.bench import BenchConfig, graph_round_default

    shape = {"method": "tree"} if args.tree else {"method": "chain", **({"k": args.chain} if args.chain else {})}
    graph_round = args.one_graph_round
    if graph_round is None:
        graph_round = graph_round_default(device, args.temperature)
    if graph_round:
        shape["graph_round"] = True
    return from_args(BenchConfig, args, **shape, device=device)


def main(args: argparse.Namespace) -> int:
    import torch

    from eyas.bench.bench import run_bench

    if getattr(args, "engine", None) or getattr(args, "url", None) or getattr(args, "plain_url", None):
        return engine_main(args)
    cfg = bench_config(args, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.allow_target_mismatch or not args.drafter:
        run_bench(cfg)
        return 0
    # The drafter is loaded here, accepting another target's fingerprint with a warning; run_bench gets both.
    import json
    import sys
    from pathlib import Path

    from eyas.manifest import atomic_write_bytes
    from eyas.model.checkpoint import open_drafter
    from eyas.target import load_target

    dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    target = load_target(cfg.target, device=cfg.device, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
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
    from eyas.bench.engine import EngineBenchConfig, run_engine_bench
    from eyas.errors import EyasError

    if not args.engine:
        raise EyasError("--url and --plain-url bench a served drafter: say which engine serves it (--engine "
                        "sglang or vllm)")
    run_engine_bench(bench_config(args, "cpu"), from_args(EngineBenchConfig, args))
    return 0
