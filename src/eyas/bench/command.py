"""`eyas bench` command line: parses arguments and calls run_bench."""

from __future__ import annotations

import argparse


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="measure acceptance length and real speedup of a drafter",
                              description="Speculative decoding benchmark with plain and prompt-lookup baselines.")
    p.add_argument("--target", default="smollm2-135m", help="target model (embedded name, HF dir, GGUF)")
    p.add_argument("--drafter", help="eyas run dir (RUN/, e.g. runs/cpu-demo), train run dir, drafter dir, or exported/published "
                        "EAGLE-3 dir (omit: baselines only)")
    p.add_argument("--prompts", default="sharegpt-heldout", help="sharegpt-heldout | humaneval | FILE.jsonl")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--chain", type=int, metavar="K", help="chain of K draft tokens (default 5)")
    shape.add_argument("--tree", action="store_true", help="EAGLE-2 dynamic tree")
    p.add_argument("--top-k", type=int, default=10, help="tree: children per node")
    p.add_argument("--depth", type=int, default=6, help="tree: depth")
    p.add_argument("--total-tokens", type=int, default=60, help="tree: draft tokens per round")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=20, help="number of prompt records (default 20)")
    p.add_argument("--max-turns", type=int, default=None, help="answer only the first N turns of each record")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip records whose first prompt is longer (counted in the report)")
    p.add_argument("--max-seq", type=int, default=2048, help="target cache length; longer prompts are left-truncated")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the target's decode steps (CUDA)")
    p.add_argument("--no-baselines", action="store_true", help="skip plain decoding and prompt lookup")
    p.add_argument("--lossless-turns", type=int, default=4, metavar="N",
                   help="greedy benches in bf16/fp16: decode the first N turns again in fp32 as the exact "
                        "lossless check (0 = off; default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="write the report here (plot next to it as .png)")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="bench a drafter whose recorded target fingerprint differs from --target's (a warning, "
                        "kept in the report's target_mismatch)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    import torch

    from eyas.bench.bench import BenchConfig, run_bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = BenchConfig(target=args.target, drafter=args.drafter, prompts=args.prompts,
                      method="tree" if args.tree else "chain", k=args.chain or 5, top_k=args.top_k,
                      depth=args.depth, total_tokens=args.total_tokens, temperature=args.temperature,
                      top_p=args.top_p, max_new_tokens=args.max_new_tokens, limit=args.limit, max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
                      max_seq=args.max_seq, device=device, dtype=args.dtype, compile=args.compile,
                      baselines=not args.no_baselines, lossless_turns=args.lossless_turns, seed=args.seed,
                      json_out=args.json_out)
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
    target = load_target(cfg.target, device=cfg.device, dtype=dtype)
    drafter, meta = open_drafter(cfg.drafter, target, allow_target_mismatch=True)
    report = run_bench(cfg, target=target, drafter=drafter, drafter_meta=meta)
    if warning := meta.get("target_mismatch"):
        print(f"warning: {warning}", file=sys.stderr)
        report["target_mismatch"] = {"warning": warning, "trained_target": meta["trained_target"]}
        if cfg.json_out:
            written = {k: v for k, v in report.items() if k != "plot"}
            atomic_write_bytes(Path(cfg.json_out), (json.dumps(written, indent=2) + "\n").encode())
    return 0
