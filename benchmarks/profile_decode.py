"""Where a speculative round spends its time: per-phase wall times (propose / verify / accept+extend, each
closed by a device sync) and the top operators by host and device time, for chains and the tree.

    python -m benchmarks.profile_decode --target T --drafter D --prompts FILE.jsonl [--limit 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--methods", default="chain3,tree")
    a = ap.parse_args()

    from eyas.data.chat import encode_prompt
    from eyas.data.prompts import load_prompts
    from eyas.decode.spec import SpecConfig, SpecDecoder
    from eyas.model.checkpoint import open_drafter
    from eyas.target import load_target
    from eyas.target.runner import Runner

    dt = torch.bfloat16 if a.device == "cuda" else torch.float32
    target = load_target(a.target, device=a.device, dtype=dt)
    drafter, _ = open_drafter(a.drafter, target=target)
    runner = Runner.from_hf(target.model, max_batch=1, max_seq=2048, device=target.device, compile=a.compile)
    recs = load_prompts(a.prompts, limit=a.limit)
    prompts = [encode_prompt(target.tokenizer, [{"role": "user", "content": r["turns"][0]}])[-1024:] for r in recs]
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    for name in a.methods.split(","):
        cfg = SpecConfig(method="tree") if name == "tree" else SpecConfig(method="chain", k=int(name[5:]))
        dec = SpecDecoder(runner, drafter, cfg)
        phases: dict[str, float] = defaultdict(float)

        def timed(label, fn):
            def wrap(*args, **kw):
                sync()
                t0 = time.perf_counter()
                out = fn(*args, **kw)
                sync()
                phases[label] += time.perf_counter() - t0
                return out
            return wrap

        dec.generate(prompts[0], 16, eos_ids=target.eos_token_ids)  # warm-up: graphs, compilation
        dec._propose = timed("propose", dec._propose)
        dec.drafting.extend = timed("drafter extend", dec.drafting.extend)
        graphed = runner.graphed  # wrap the replay, not the captured function (no sync inside a capture)
        runner.graphed = lambda *args, **kw: timed("verify forward", graphed(*args, **kw))
        runner.copy_slots = timed("copy_slots", runner.copy_slots)
        rounds = tokens = 0
        sync()
        t0 = time.perf_counter()
        for p in prompts:
            _, st = dec.generate(p, a.max_new_tokens, eos_ids=target.eos_token_ids)
            rounds, tokens = rounds + st.rounds, tokens + st.tokens
        sync()
        wall = time.perf_counter() - t0
        print(f"\n== {name}: {tokens} tokens, {rounds} rounds, {tokens / wall:.1f} tok/s, "
              f"{1e3 * wall / max(rounds, 1):.2f} ms/round (prompt lengths {[len(p) for p in prompts]})")
        for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<16} {1e3 * v / max(rounds, 1):8.2f} ms/round  ({v / wall:.0%})")
        del runner.copy_slots, runner.graphed
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
        dec2 = SpecDecoder(runner, drafter, cfg)
        dec2.generate(prompts[0], 16, eos_ids=target.eos_token_ids)
        with torch.profiler.profile(activities=acts) as prof:
            dec2.generate(prompts[-1], 48, eos_ids=target.eos_token_ids)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        if a.device == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
