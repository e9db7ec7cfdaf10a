"""Compile regions against the whole-step compile: compile time and step time of the target runner.

    PYTHONPATH=src python benchmarks/compile_regions.py [--target smollm2-135m] [--dtype bf16] [--k 5]

`Runner.from_hf(compile=True)` compiles the whole unrolled N-layer step; with `regions=True` inductor compiles
the decoder layer once (torch.compiler.nested_compile_region) and calls it N times. Each variant runs in its own
process with empty inductor and Triton caches, and measures:
- compile s: warming the shapes a chain-K bench uses (`eyas.bench.startup.warm_up`): the plain decode step (S=1)
  and the verify step with the drafter's aux capture (S=K+1), compile and CUDA-graph capture included;
- decode ms / verify ms: the mean of `--reps` calls of each warmed step (CUDA-graph replays on CUDA), attending
  all max_seq slots as in `eyas bench`;
- the greedy tokens of one prompt, to compare the variants.

Prints a table and appends it, with date, machine and command, to BENCHMARKS.md (or --md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

VARIANTS = ("whole", "regions")


def measure(args) -> dict:
    from eyas.bench.startup import warm_up
    from eyas.target import load_target
    from eyas.target.runner import Runner

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target = load_target(args.target, device=dev, dtype=dtype)
    M, S = args.max_seq, args.k + 1
    r = Runner.from_hf(target.model, max_batch=1, max_seq=M, compile=True, regions=args.variant == "regions")
    step = r.step_fn(tuple(target.aux_layer_ids))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    warm_up(r, [(None, [1]), (step, [S])])
    sync()
    compile_s = time.perf_counter() - t0
    out = {"variant": args.variant, "compile_s": compile_s}
    for name, fn, n in (("decode_ms", None, 1), ("verify_ms", step, S)):
        g = r.graphed(1, n, fn)
        ids = torch.randint(3, 1000, (1, n), device=dev)
        pos = torch.arange(M - n - 1, M - 1, device=dev)[None]  # the last slots: every step attends M-1 of them
        mask = torch.ones(1, n, M, dtype=torch.bool, device=dev).tril(M - n - 1)
        g(ids, pos, pos, mask)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            g(ids, pos, pos, mask)
        sync()
        out[name] = 1e3 * (time.perf_counter() - t0) / args.reps
    out["tokens"] = greedy(r.graphed(1, 1), target.tokenizer.encode("Write a short poem about the sea."), 32, M, dev)
    return out


def greedy(step, prompt: list[int], n: int, M: int, dev) -> list[int]:
    """n greedy tokens after `prompt`, one token per call of the warmed S=1 step (no other shape compiles)."""
    toks, mask = list(prompt), torch.zeros(1, 1, M, dtype=torch.bool, device=dev)
    for i in range(len(prompt) + n - 1):
        pos = torch.tensor([[i]], device=dev)
        mask[..., i] = True
        logits = step(torch.tensor([[toks[i]]], device=dev), pos, pos, mask)
        if i >= len(prompt) - 1:
            toks.append(int(logits[0, -1].argmax()))
    return toks[len(prompt):]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--k", type=int, default=5, help="draft tokens of the chain whose verify step is compiled")
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variant", choices=VARIANTS, default=None, help="(internal) measure one variant, print JSON")
    ap.add_argument("--md", default="BENCHMARKS.md")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return 0
    rows = {}
    for v in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
            cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", v]
            p = subprocess.run(cmd, env=env, text=True, capture_output=True)
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                return p.returncode
            rows[v] = json.loads(p.stdout.strip().splitlines()[-1])
            print(v, {k: x for k, x in rows[v].items() if k != "tokens"}, flush=True)
    w, g = rows["whole"], rows["regions"]
    same = sum(a == b for a, b in zip(w["tokens"], g["tokens"]))
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or "cpu")
    table = (f"\n## compile regions vs whole-step compile, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
             f"- machine: {machine}; torch {torch.__version__}; dtype {args.dtype}; threads {torch.get_num_threads()}\n"
             f"- command: `{' '.join(['python'] + sys.argv)}`\n"
             f"- target {args.target}; cache {args.max_seq} slots; steps: plain decode (S=1) and chain-{args.k} verify "
             f"with aux capture (S={args.k + 1}); each variant in its own process with empty compile caches\n\n"
             "| variant | compile + capture s | decode step ms | verify step ms |\n|---|---|---|---|\n"
             + "".join(f"| {v} | {rows[v]['compile_s']:.1f} | {rows[v]['decode_ms']:.3f} | {rows[v]['verify_ms']:.3f} |\n"
                       for v in VARIANTS)
             + f"\n- regions / whole: compile {g['compile_s'] / w['compile_s']:.2f}x, decode step "
               f"{g['decode_ms'] / w['decode_ms']:.2f}x, verify step {g['verify_ms'] / w['verify_ms']:.2f}x; greedy "
               f"tokens of one prompt equal at {same}/{len(w['tokens'])} positions\n")
    print(table)
    with open(args.md, "a") as f:
        f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
