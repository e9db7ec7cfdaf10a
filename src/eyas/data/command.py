"""`eyas prepare`: argument parsing only; the work is eyas.data.prepare.run_prepare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyas.errors import EyasError


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prepare", help="tokenize conversations with loss masks (train split only)",
        description="Tokenize conversations with the target's chat template and assistant loss masks; "
                    "writes the TRAIN split (held-out ids are skipped) and manifest.json. "
                    "Rerunning the same command resumes an interrupted run.")
    p.add_argument("--target", default="smollm2-135m", help="smollm2-135m, an HF dir, a hub id (offline) or a GGUF file")
    p.add_argument("--data", default="sharegpt", help="sharegpt, a ShareGPT .json or an OpenAI-messages .jsonl")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--limit", type=int, default=None, help="stop after N kept training conversations")
    p.add_argument("--max-len", type=int, default=2048,
                   help="truncate conversations to L tokens, also the token budget of regeneration (default 2048)")
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="fraction held out for bench (default 0.05)")
    p.add_argument("--regenerate", action="store_true", help="replace assistant turns with the target's own replies")
    p.add_argument("--regenerate-limit", type=int, default=None,
                   help="regenerate only the first N conversations; later ones keep the dataset's replies")
    p.add_argument("--server", default=None, help="regenerate through this OpenAI-compatible server URL")
    p.add_argument("--model", default=None, help="model name on the server (default: its first model)")
    p.add_argument("--concurrency", type=int, default=8, help="server requests in flight (default 8)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per server request (default 120)")
    p.add_argument("--retries", type=int, default=3, help="retries per server request (default 3)")
    p.add_argument("--regen-temperature", "--temperature", dest="regen_temperature", type=float, default=0.0,
                   help="temperature of regenerated replies; 0 = greedy (default)")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="with --regenerate: N sampled reply sets per conversation, ids <id>#s1..#sN (default 1)")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="also write N conversations whose user turn the target samples from the template's "
                        "user header (Magpie), replied greedily; ids magpie-<n> (default 0)")
    p.add_argument("--self-prompt-temperature", type=float, default=1.0,
                   help="temperature of the self-written user turns (default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest regenerated reply (default 512)")
    p.add_argument("--batch-size", type=int, default=16, help="conversations per generation batch / commit")
    p.add_argument("--gen-batch", type=int, default=None,
                   help="rows per local generation forward (default: --batch-size)")
    p.add_argument("--regen-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="weights dtype for local regeneration (default: the target's)")
    p.add_argument("--max-turns", type=int, default=None,
                   help="keep (and regenerate) only the first N user turns of each conversation (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="start again instead of resuming")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's remote code")
    p.add_argument("--verbose", action="store_true", help="print every skipped record and dropped sample "
                   "(always written to OUT/skipped.jsonl)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from eyas.data.prepare import PrepareConfig, format_counts, run_prepare, skipped_lines

    try:
        cfg = PrepareConfig(
            target=args.target, data=args.data, out=args.out, limit=args.limit, max_len=args.max_len,
            heldout_fraction=args.heldout_fraction, regenerate=args.regenerate, regenerate_limit=args.regenerate_limit, server=args.server,
            model=args.model, concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
            regen_temperature=args.regen_temperature, samples_per_prompt=args.samples_per_prompt,
            self_prompts=args.self_prompts, self_prompt_temperature=args.self_prompt_temperature,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, max_turns=args.max_turns, regen_dtype=args.regen_dtype, gen_batch=args.gen_batch,
            seed=args.seed, overwrite=args.overwrite, trust_remote_code=args.trust_remote_code)
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
