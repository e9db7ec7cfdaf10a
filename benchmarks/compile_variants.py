"""Compile variants of the target runner: compile time and step time (issue 14: bench start-up, plain decoding).

    python -m benchmarks.compile_variants [--target smollm2-135m] [--dtype bf16] [--k 5] \
        [--variants whole,regions,cdt,autotune,combo,flex,gemv,gemv8,gemv-autotune,gemv-regions]

`Runner.from_hf(compile=True)` compiles the whole unrolled N-layer step ("whole"). The variants:
- regions: inductor compiles the decoder layer once (torch.compiler.nested_compile_region) and calls it N times;
- cdt: inductor's coordinate-descent tuning of each Triton kernel's launch configuration;
- autotune: max-autotune GEMM templates (matmuls as Triton templates with fused epilogues) plus cdt;
- combo: combo kernels (independent small kernels fused horizontally, fewer launches per layer);
- flex: attention through flex_attention (`Runner.from_hf(attention="flex")`: one fused kernel per layer, split
  over the keys for few queries) instead of the matmul/softmax/matmul path;
- gemv, gemv8: the layer projections of steps of at most 1 / 8 rows as inductor reductions, not cuBLAS GEMMs
  (`Runner.from_hf(gemv=1|8)`): the decode step / also the chain verify step. gemv (R = 1) is the runner's default
  for static compiles on CUDA since session 13; every other variant sets gemv=0, to isolate its own effect;
- gemv-autotune, gemv-regions: that default with autotune's options / with compile regions (the candidates for the
  verify step's small GEMMs and for start-up);
- gemv-persist: that default with the steps saved by `aot_compile` (`Runner.from_hf(persist=DIR)`, DIR beside the
  variant's inductor cache): the second process loads them without a dynamo trace (start-up).
Each variant runs in its own process with empty inductor and Triton caches (and a time limit), and measures:
- compile s: warming the shapes a chain-K bench uses (`eyas.bench.startup.warm_up`): the plain decode step (S=1)
  and the verify step with the drafter's aux capture (S=K+1), compile and CUDA-graph capture included; then
  again in a second process on the caches the first filled (what a later bench pays: dynamo tracing, cache
  loads and capture);
- decode ms / verify ms: the mean of `--reps` calls of each warmed step (CUDA-graph replays on CUDA), attending
  all max_seq slots as in `eyas bench`; 1000 / decode ms is the batch-1 plain decoding rate the step allows;
- the greedy tokens of one prompt, compared with the first variant's.

Prints a table and appends it as a dated section to BENCHMARKS.md (benchmarks.record: --md FILE, --no-record).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import record

VARIANTS = {"whole": {}, "regions": {}, "cdt": {"coordinate_descent_tuning": True},
            "autotune": {"max_autotune": True, "coordinate_descent_tuning": True}, "combo": {"combo_kernels": True},
            "flex": {}, "gemv": {}, "gemv8": {},
            "gemv-autotune": {"max_autotune": True, "coordinate_descent_tuning": True}, "gemv-regions": {},
            "gemv-persist": {}}
"""inductor options of each variant (regions: none, its compile regions instead; flex: none, flex attention; gemv,
gemv8: none, reductions for the projections of steps of <= 1 / 8 rows; gemv-*: gemv=1 with the named variant)."""


def measure(args) -> dict:
    from eyas.bench.startup import warm_up
    from eyas.target import load_target
    from eyas.target.runner import Runner

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target = load_target(args.target, device=dev, dtype=dtype)
    M, S = args.max_seq, args.k + 1
    r = Runner.from_hf(target.model, max_batch=1, max_seq=M, compile=True, regions=args.variant.endswith("regions"),
                       compile_options=VARIANTS[args.variant], attention="flex" if args.variant == "flex" else "matmul",
                       gemv=8 if args.variant == "gemv8" else int(args.variant.startswith("gemv")),
                       persist=(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "eyas-steps")
                                if args.variant.endswith("persist") else None))
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


def run_variant(cmd, env, timeout) -> dict:
    """One variant process: its JSON line, or {"error": ...}."""
    try:
        p = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:160]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--k", type=int, default=5, help="draft tokens of the chain whose verify step is compiled")
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variants", default=None,
                    help=f"comma list of {', '.join(VARIANTS)} (default: all on CUDA; whole,regions on the CPU, the "
                         "others tune Triton kernels)")
    ap.add_argument("--variant-timeout", type=float, default=300, help="seconds per variant process")
    ap.add_argument("--variant", choices=list(VARIANTS), default=None, help="(internal) measure one variant, print JSON")
    record.add_options(ap)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return 0
    names = (args.variants or (",".join(VARIANTS) if torch.cuda.is_available() else "whole,regions")).split(",")
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {', '.join(bad)}")
    rows = {}
    own = ["--target", args.target, "--dtype", args.dtype, "--k", str(args.k), "--max-seq", str(args.max_seq),
           "--reps", str(args.reps)]
    for v in names:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
            cmd = [sys.executable, "-m", __spec__.name, *own, "--variant", v]
            rows[v] = run_variant(cmd, env, args.variant_timeout)
            if "error" not in rows[v]:  # again in a fresh process on the caches the first one filled
                warm = run_variant(cmd, env, args.variant_timeout)
                rows[v]["warm_compile_s"] = warm.get("compile_s")
            print(v, {k: x for k, x in rows[v].items() if k != "tokens"}, flush=True)
    ref = next((r for r in rows.values() if "tokens" in r), None)

    def row(v: str) -> str:
        r = rows[v]
        if "error" in r:
            return f"| {v} | failed: {r['error']} | | | | | |\n"
        same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"]))
        warm = f"{r['warm_compile_s']:.1f}" if r.get("warm_compile_s") is not None else "failed"
        return (f"| {v} | {r['compile_s']:.1f} | {warm} | {r['decode_ms']:.3f} | {1e3 / r['decode_ms']:,.0f} | "
                f"{r['verify_ms']:.3f} | {same}/{len(ref['tokens'])} |\n")

    table = ("| variant | compile + capture s (empty caches) | same, warm caches (a second process) | decode step ms | "
             "plain tok/s bound | verify step ms | greedy tokens equal to the first variant's |\n"
             "|---|---|---|---|---|---|---|\n" + "".join(row(v) for v in names))
    print(record.write(args, "Runner compile variants", table, command=record.command_line(__spec__.name),
                       details=[f"dtype {args.dtype}; threads {torch.get_num_threads()}",
                                f"target {args.target}; cache {args.max_seq} slots; steps: plain decode (S=1) and "
                                f"chain-{args.k} verify with aux capture (S={args.k + 1}); each variant in its own "
                                "process with empty compile caches"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
