"""Training's compile in a background process while prepare runs: `eyas run` takes it off the train stage's clock.

A compiled training run spends its first step tracing and compiling the drafter's layer for every TTT step, forward,
backward and eval (its share of the train stage, the `train start-up` line of
BENCHMARKS.md#eyas-run-gpu-preset-with-trainings-compile-during-prepare-issue-33--2026-12-04-1238-1251-utc); prepare before it keeps the GPU
busy with regeneration and leaves most CPU cores idle. So, when the train stage compiles and trains online, `eyas run` starts
`python -m eyas.train.prewarm SPEC RESULT` as prepare starts: its own CUDA context, niced, in a session of its own
(the parent side is eyas/bench/prewarm.py's Prewarm). It writes a small prepared dataset of random tokens for the
same target, with samples of half the training length so that packing fills the same (rows, max_len) micro-batches,
and runs the real Trainer on it with the run's train config for two steps and the final eval. Compiled code depends
on shapes and dtypes, not on token or weight values, so the train stage then finds its graphs in inductor's caches
on disk ($EYAS_CACHE/inductor, eyas.target.compile.compile_cache, which both processes open).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from eyas.warmup import Prewarm, anchored, watch_parent

NAME = "train-prewarm"
"""Its files under RUN/logs: NAME-spec.json, NAME.json, NAME.log, and the directory NAME/ (data and run)."""
STEPS = 2
WAIT_S = 300.0
"""Longest wait, before the train stage, for an unfinished warm-up; then it is stopped and training compiles."""


def synthetic_samples(vocab_size: int, max_len: int, eval_fraction: float, batch_tokens: int, seed: int = 0):
    """(id, token ids, loss mask) of random samples of max_len // 2 tokens (the second half trainable): enough
    training samples for STEPS packed micro-batches of `batch_tokens` and at least one held-out sample (the
    trainer's own split by id)."""
    import torch

    from eyas.train.data import is_eval

    n = max(3, max_len // 2)
    per_step = max(2, batch_tokens // n)
    g = torch.Generator().manual_seed(seed)
    out, n_train, n_eval, i = [], 0, 0, 0
    while n_train < STEPS * per_step + 1 or (eval_fraction > 0 and n_eval < 1):
        sid = f"warm-{i}"
        held = is_eval(sid, eval_fraction)
        if held and n_eval >= 2:  # a few held-out samples are enough: the eval graphs are one packed shape
            i += 1
            continue
        ids = torch.randint(0, vocab_size, (n,), generator=g).tolist()
        out.append((sid, ids, [False] * (n // 2) + [True] * (n - n // 2)))
        n_eval, n_train, i = n_eval + held, n_train + (not held), i + 1
    return out


def warm(spec: dict) -> dict:
    """Run the Trainer of spec["train"] (a TrainConfig dict) for STEPS steps and the final eval on synthetic data
    under spec["root"]; returns the trainer's start-up and the compile cache's hits and misses."""
    import torch

    from eyas.target.compile import compile_cache
    from eyas.data.prepared import PreparedWriter, Sample
    from eyas.target import load_target
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import Trainer

    root = Path(spec["root"])
    shutil.rmtree(root, ignore_errors=True)  # an interrupted run's scratch: the Trainer refuses an existing run dir
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    target = load_target(spec["target"], device=spec["device"], dtype=dtype,
                         trust_remote_code=spec.get("trust_remote_code", False))
    cfg = TrainConfig.from_dict(spec["train"])
    w = PreparedWriter(root / "prepared", identity={"target": target.fingerprint, "warm-up": True}, overwrite=True)
    samples = synthetic_samples(target.vocab_size, cfg.max_len, cfg.eval_fraction, cfg.batch_tokens)
    for sid, ids, mask in samples:
        w.add(Sample(id=sid, input_ids=ids, loss_mask=mask))
    w.commit(len(samples), {})
    w.finish({"target": target.fingerprint, "counts": {"kept": len(samples)}})
    cfg = replace(cfg, data=str(root / "prepared"), store=None, out=str(root / "train"), steps=STEPS, epochs=None,
                  resume=False, eval_every=0, checkpoint_every=0, log_every=1, progress=False, prefetch=False)
    with compile_cache(cfg.compile) as cache:
        trainer = Trainer(cfg, target)
        trainer.train()
    manifest = json.loads((root / "train" / "manifest.json").read_text())
    return {"startup": manifest.get("startup"), "compile_cache": cache, "samples": len(samples)}


def main(argv: list[str] | None = None) -> int:
    from eyas.manifest import atomic_write_bytes

    spec_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    watch_parent(spec["parent"])
    os.nice(spec.get("nice", 10))  # prepare comes first; inductor's compile workers inherit this
    t0 = time.time()
    result = warm(spec)
    result["seconds"] = round(time.time() - t0, 1)
    atomic_write_bytes(Path(result_path), (json.dumps(result, indent=2) + "\n").encode())
    return 0


def start(logs: Path, train, *, target_spec: str, device: str, dtype: str, trust_remote_code: bool = False):
    """Start the warm-up of `train` (the run's TrainConfig) in the background; returns its Prewarm."""

    # the warm-up runs in the run directory (Prewarm): the paths it reads are made absolute here
    t = train.to_dict()
    spec = {"target": anchored(target_spec), "device": device, "dtype": dtype, "trust_remote_code": trust_remote_code,
            "train": {**t, "target": anchored(t["target"]), "init": anchored(t["init"])}, "root": str(logs / NAME)}
    return Prewarm(logs, spec, cmd=command, name=NAME, digest=dict)  # the whole result, its own seconds included


def command(spec: Path, result: Path) -> list[str]:
    return [sys.executable, "-m", "eyas.train.prewarm", str(spec), str(result)]


if __name__ == "__main__":
    sys.exit(main())
