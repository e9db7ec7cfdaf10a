"""Bench warm-up in a background process: `eyas run` compiles the bench's graphs while the drafter trains.

A bench process that finds inductor's caches cold spends minutes compiling
(BENCHMARKS.md#the-gpu-recipes-first-bench-one-eyas-bench-process-with-a-cold-inductor-cache-then-one-with-a-warm-one); the train stage
before it keeps the GPU busy and the CPU mostly idle. So `eyas run` starts `python -m eyas.bench.prewarm SPEC
RESULT` at the start of the train stage: its own CUDA context, niced, in a session of its own. It opens the
target, builds a drafter of the exact config training will write (random weights: compiled code depends on
shapes and dtypes, not on weight values), and runs every pending bench's own set-up and warm-up
(`run_bench(..., warm_only=True)`), which leaves the FX-graph cache under $EYAS_CACHE/inductor (and, with
persist_steps, the saved steps) warm for the bench proper. RESULT gets one warm-up report per bench.

The process itself, its wait and its stop: eyas/warmup.py (`Prewarm`), shared with training's warm-up.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from eyas.warmup import Prewarm, await_warmup, stop_stale, watch_parent  # noqa: F401 (stop_stale: run.py's)
from eyas.warmup import anchored as anchored_path

AUTO_SHARE = 0.05
"""Auto mode warms only when the warm-up's own copy of the target's weights takes at most this share of the GPU's
memory: beside training, a second copy of a large target could push training out of memory."""
WAIT_S = 300.0
"""Longest wait, after training, for an unfinished warm-up: about two cold compiles of a bench
(BENCHMARKS.md#the-gpu-recipes-first-bench-one-eyas-bench-process-with-a-cold-inductor-cache-then-one-with-a-warm-one);
the bench compiles what is left after that."""


# ---- the child --------------------------------------------------------------------------------------------------

def warm(spec: dict, out=None) -> dict:
    """Warm every bench of `spec` (see Prewarm.start) in this process; returns {"benches": {name: warm-up report}}."""
    import torch

    from eyas.bench.bench import BenchConfig, run_bench
    from eyas.model.dflash import DFlashConfig, DFlashDrafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from eyas.target import load_target

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    target = load_target(spec["target"], device=spec["device"], dtype=dtype,
                         trust_remote_code=spec.get("trust_remote_code", False))
    dc = spec["drafter"]  # the drafter config training writes, either kind
    drafter = (DFlashDrafter(DFlashConfig.from_dict(dc)) if dc.get("kind") == "dflash"
               else Eagle3Drafter(DrafterConfig.from_dict(dc))).to(target.device)  # fp32, as open_drafter's
    reports = {}
    for name, d in spec["benches"].items():
        cfg = BenchConfig.from_dict({**d, "json_out": None})
        reports[name] = run_bench(cfg, target=target, drafter=drafter, warm_only=True, out=out or sys.stdout)
    return {"benches": reports}


def main(argv: list[str] | None = None) -> int:
    spec_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    watch_parent(spec["parent"])
    os.nice(spec.get("nice", 10))  # the training process comes first; inductor's compile workers inherit this
    t0 = time.time()
    result = warm(spec)
    result["seconds"] = round(time.time() - t0, 1)
    from eyas.manifest import atomic_write_bytes
    atomic_write_bytes(Path(result_path), (json.dumps(result, indent=2) + "\n").encode())
    return 0


# ---- the parent -------------------------------------------------------------------------------------------------

def command(spec: Path, result: Path) -> list[str]:
    """The warm-up process's command line."""
    return [sys.executable, "-m", "eyas.bench.prewarm", str(spec), str(result)]


def fits_beside_training(target) -> bool:
    """Whether the warm-up's copy of `target`'s weights takes at most AUTO_SHARE of its GPU's memory (always, off
    a GPU)."""
    import torch

    if target.device.type != "cuda":
        return True
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    return weights <= AUTO_SHARE * torch.cuda.get_device_properties(target.device).total_memory


def planned_drafter_config(train, target):
    """The DrafterConfig the train stage of `train` (a TrainConfig) will write: train/setup.py run_drafter_config,
    the Trainer's own rule, on the config resolved for its device (and --init's vocabulary, if any)."""
    import torch

    from eyas.train.setup import run_drafter_config

    tcfg, _ = train.for_device(torch.device(train.device))
    init = None
    if tcfg.init:
        from eyas.model.checkpoint import open_drafter
        init = open_drafter(tcfg.init, target, allow_target_mismatch=tcfg.allow_target_mismatch)[0].config
    return run_drafter_config(tcfg, target, init)


def start(logs: Path, benches: dict, train, target, *, target_spec: str, dtype: str,
          trust_remote_code: bool = False) -> "Prewarm":
    """Start warming `benches` ({name: BenchConfig}) for the drafter `train` will write, in the background."""
    dcfg = planned_drafter_config(train, target)
    spec = {"target": anchored(target_spec), "device": next(iter(benches.values())).device, "dtype": dtype,
            "trust_remote_code": trust_remote_code, "drafter": json.loads(json.dumps(dcfg.to_dict())),
            "benches": {n: {**(d := b.to_dict()), **{k: anchored(d[k]) for k in ("target", "drafter", "prompts")}}
                        for n, b in benches.items()}}
    # `command` looked up at call time: tests swap in a process made to fail
    return Prewarm(logs, spec, cmd=command, digest=bench_digest)


def anchored(spec: str | None) -> str | None:
    """`spec` made absolute where it is a relative path here (eyas/warmup.py anchored); a prompt set's name stays."""
    from eyas.bench.bench import PROMPT_SETS

    return anchored_path(spec, keep=(*PROMPT_SETS, "sharegpt"))


def await_before_bench(proc: "Prewarm", log) -> dict:
    """Before the bench stage: wait for the warm-up (at most WAIT_S, then stop it), say in one log line how it went,
    and return what run.json records: Prewarm.record() plus finished_before_bench and waited_s."""
    return await_warmup(proc, log, WAIT_S, stage="bench", beside="training", marker="benches", who="the bench")


def bench_digest(result: dict) -> dict:
    """What run.json keeps of the bench warm-up's result: each bench's warm-up report, seconds and compile cache."""
    return {"benches": {n: {"warmup": r["warmup"], "seconds": r["seconds"],
                            **({"compile_cache": r["compile_cache"]} if "compile_cache" in r else {})}
                        for n, r in result["benches"].items()}}


if __name__ == "__main__":
    sys.exit(main())
