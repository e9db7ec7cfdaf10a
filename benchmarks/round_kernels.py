"""Kernels per decode step and per speculative round (issue 14: plain decoding toward 1,000 tok/s, a chain-5 round
toward 1.5 plain steps, a tree round toward 2.5): what one replay of each captured step launches on the device.

For each of: the plain decode step (the runner's graph over all max_seq slots, as `eyas bench`), a one-graph
chain round (K), a one-graph tree round, each replayed R times back to back after a warm-up decode:
- wall ms per replay (the device kept busy: nothing waits for the host between replays);
- kernels per replay and their summed device time (from the profiler's CUDA activity), so busy/wall says
  whether the step is bound by its kernels or by gaps between them;
- the kernels with the most device time per replay.
A round replays from the state the warm-up decode left, each replay committing its accepted tokens, so R is kept
small enough for the cache.

    PYTHONPATH=src python benchmarks/round_kernels.py --target T --drafter D --compile [--chain 5] [--reps 30]
    PYTHONPATH=src python benchmarks/round_kernels.py --tiny --dtype fp32 --reps 3      # CPU smoke (operators, no CUDA)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections import defaultdict

import torch


@torch.no_grad()  # as generate() runs a round; on the CPU (no graph) `fn` runs its body, which grad mode steers
def profile(fn, reps: int, device) -> dict:
    """Replay `fn` reps times under the profiler: wall ms, kernels (device events) and their device ms per replay,
    and the top kernels by device time per replay."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize()
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps
    per = defaultdict(float)
    count = 0
    for e in prof.events():
        on_device = cuda and e.device_type == torch.autograd.DeviceType.CUDA
        if on_device or (not cuda and e.cpu_parent is None):  # CPU: top-level operators stand in
            count += 1
            per[e.name] += e.device_time_total if cuda else e.cpu_time  # a device event's total is its own time
    busy = sum(per.values()) / reps / 1e3
    top = sorted(per.items(), key=lambda kv: -kv[1])[:8]
    return dict(wall_ms=1e3 * wall, kernels=count / reps, busy_ms=busy,
                top=[(name[:70], us / reps) for name, us in top])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="an eyas export or drafter dir (default: a random drafter)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--compile", action="store_true", help="compile the runner and the drafter's steps")
    ap.add_argument("--chain", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (CPU smoke)")
    ap.add_argument("--md", default="BENCHMARKS.md")
    args = ap.parse_args()

    from decode import tiny_target
    from eyas.decode.common import SpecConfig
    from eyas.decode.round import RoundDecoder
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from eyas.target.runner import Runner

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.tiny:
        target = tiny_target()
        target.model.to(device=dev, dtype=dtype)
    else:
        from eyas.target import load_target
        target = load_target(args.target, device=dev, dtype=dtype)
    if args.drafter:
        from eyas.model.checkpoint import open_drafter
        drafter, _ = open_drafter(args.drafter, target=target)
    else:
        torch.manual_seed(0)
        drafter = Eagle3Drafter(DrafterConfig.from_target(target.config, draft_vocab_size=min(32000, target.vocab_size),
                                                          aux_layer_ids=target.aux_layer_ids))
    M = args.max_seq
    r = Runner.from_hf(target.model, max_batch=1, max_seq=M, compile=args.compile)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, target.vocab_size, (256,), generator=g).tolist()
    rows, results = [], {}

    # plain: the bench's step (window 0: all max_seq slots), replayed with fixed inputs
    r.generate([prompt], 8, window=0)
    step = r.graphed(1, 1, slots=M)
    ids = torch.tensor([[prompt[-1]]], device=dev)
    pos = torch.tensor([[len(prompt)]], device=dev)
    mask = (torch.arange(M, device=dev) <= len(prompt))[None, None]
    results["plain step"] = profile(lambda: step(ids, pos, pos, mask), args.reps, dev)

    rounds = [(f"chain-{args.chain} round", SpecConfig(method="chain", k=args.chain)),
              ("tree round (10/6/60)", SpecConfig(method="tree"))]
    for name, cfg in rounds:
        dec = RoundDecoder(r, drafter, cfg, compile_drafter=args.compile)
        dec.generate(prompt, 8)  # captures the round; leaves a committed state to replay from
        room = (M - len(prompt) - 8 - 2 * dec.width) // (dec.K + 1)
        reps = max(1, min(args.reps, room))
        dec._capture()
        results[name] = profile(dec._run, reps, dev)

    if dev.type == "cuda" and not any(res["kernels"] for res in results.values()):
        print("warning: the profiler saw no kernels inside the graph replays (CUPTI); busy and kernel columns are 0",
              file=sys.stderr)
    plain = results["plain step"]["wall_ms"]
    for name, res in results.items():
        rows.append((name, f"{res['wall_ms']:.3f} ms/replay ({res['wall_ms'] / plain:.2f} plain steps), "
                           f"{res['kernels']:.0f} kernels, device busy {res['busy_ms']:.3f} ms "
                           f"({res['busy_ms'] / res['wall_ms']:.0%} of wall)"))
        rows.append((f"{name}: top kernels (us per replay)",
                     "; ".join(f"{k} {v:.1f}" for k, v in res["top"])))
        print(rows[-2], flush=True)
    machine = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    table = (f"\n## Kernels per decode step and round, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
             f"- machine: {machine}; torch {torch.__version__}; dtype {args.dtype}; compile {args.compile}\n"
             f"- command: `{' '.join(['python'] + sys.argv)}`\n"
             f"- target: {'tiny random Llama' if args.tiny else args.target}; drafter: {args.drafter or 'random'}; "
             f"cache {M}; prompt 256 random tokens\n"
             + ("- CPU: no CUDA activity, so 'kernels' counts top-level operators and 'busy' their CPU time\n"
                if dev.type != "cuda" else "")
             + "\n| what | result |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows))
    print(table)
    with open(args.md, "a") as f:
        f.write(table)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    raise SystemExit(main())
