"""A run sized to its time budget: measure this machine on the stages' own code, then choose how much data to use.

A recipe with `[run] budget_minutes` (the cpu-demo's 20) must fit that budget on whatever CPU it meets, and the
same plan runs far slower where the CPU falls back to fp32 (no native bf16), and slower in a busy hour of a shared
machine (docs/LOG.md has the measurements). So before the first stage, `eyas run` times the work each stage does,
at the stage's shapes and in the run's dtype, on this machine (`measure`):
- prepare: its own reading and tokenizing of the data's first conversations, which also gives their lengths;
- regeneration: the target's batched prefill and decode steps (the Runner that prepare generates with);
- capture: `run_capture` over random tokens in those lengths;
- training: the Trainer, offline from that small store, for a few steps (the first, with its set-up, not counted);
- the bench: batch-1 decode steps in the bench's dtype and in fp32 (the lossless rerun).
From those rates and the plan's counts `estimate` predicts each stage's seconds, and `choose` scales the plan's
conversations (prepare.limit, prepare.regenerate_limit) and bench prompts by one factor so that the sum fits the
budget less RESERVE; it never grows a plan. The choice is saved in run.json (eyas.run), so that a resumed run keeps
its plan. A size the user set with --set is kept as given.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eyas.capture.capture import CaptureConfig, run_capture
from eyas.data.prepare import run_prepare
from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.target.runner import Runner
from eyas.train.trainer import Trainer

LENGTH_SAMPLE = 256
"""Conversations of the data read to measure their token lengths."""
DECODE_STEPS = 8
"""Decode steps timed per measurement (after one untimed step)."""
TRAIN_STEPS = 4
"""Training steps timed (the first one, with the trainer's set-up and first features, is not counted)."""
RESERVE = 0.2
"""The share of the budget the plan leaves free: a shared machine's speed moves during a run, so stages can take
longer than the rates measured at its start (docs/LOG.md, the cpu-demo's sizing, has how much)."""
MIN_CONVERSATIONS = 200
MIN_BENCH_PROMPTS = 8
"""The smallest plan `choose` goes to: fewer conversations train no drafter worth benching, fewer prompts say little."""


@dataclass(frozen=True)
class Rates:
    """What this machine did, measured by `measure` (seconds per unit)."""

    read_s_per_conversation: float
    """Prepare's reading, tokenizing and writing of one conversation kept as written."""
    prefill_s_per_token: float
    """The target's batched prefill (regeneration's prompts)."""
    decode_s_per_step: float
    """One decode step of gen_batch rows (regeneration)."""
    capture_s_per_token: float
    """run_capture, store writes included."""
    train_s_per_token: float
    """One offline training step's seconds over its tokens."""
    bench_s_per_token: float
    """A batch-1 decode step in the bench's dtype."""
    lossless_s_per_token: float
    """A batch-1 decode step in fp32 (the bench's exact lossless rerun)."""
    prompt_tokens: float
    """Mean prompt length (tokens before the first reply) of the conversations prepare keeps."""
    sample_tokens: float
    """Mean length of the conversations prepare keeps with the data's own replies."""
    regen_tokens: float
    """Mean length of those conversations with a reply of max_new_tokens instead (at most max_len): an upper bound
    for a regenerated one."""
    seconds: float
    """What measuring took."""

    def to_dict(self) -> dict:
        return {k: round(v, 7) for k, v in self.__dict__.items()}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def data_lengths(prepare, target, root: Path) -> tuple[list[int], list[int], float]:
    """(prompt tokens, conversation tokens, seconds per kept conversation) of the first LENGTH_SAMPLE conversations
    prepare keeps from the data, as prepare itself reads, tokenizes, cuts and filters them (without regeneration):
    its own code under `root`."""
    cfg = replace(prepare, out=str(root / "prepared"), limit=LENGTH_SAMPLE, regenerate=False, overwrite=True,
                  regen=replace(prepare.regen, self_prompts=0, regenerate_limit=None))
    seconds = _timed(lambda: run_prepare(cfg, target, progress=False))
    prompts, lengths = [], []
    for sample in PreparedData(cfg.out, target=target):
        lengths.append(len(sample.input_ids))
        prompts.append(next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.loss_mask)))
    if not lengths:
        raise EyasError(f"{prepare.data}: prepare kept none of its first {LENGTH_SAMPLE} conversations")
    return prompts, lengths, seconds / len(lengths)


def _decode_rate(model, *, rows: int, prompt_len: int, dtype, vocab: int) -> tuple[float, float]:
    """(prefill seconds per token, seconds per decode step) of `rows` random prompts on a Runner."""
    runner = Runner.from_hf(model, max_batch=rows, max_seq=prompt_len + DECODE_STEPS + 2, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (rows, prompt_len), generator=g).tolist()
    one = _timed(lambda: runner.generate(prompts, 1))
    one = min(one, _timed(lambda: runner.generate(prompts, 1)))  # the first call also warms the kernels
    many = _timed(lambda: runner.generate(prompts, 1 + DECODE_STEPS))
    return one / (rows * prompt_len), max(many - one, 1e-6) / DECODE_STEPS


def _train_rate(metrics: Path) -> float:
    """Seconds per token of the training steps after the first, from the Trainer's metrics.jsonl (each step logs
    its cumulative tokens and the rate since the start)."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if '"split": "train"' in line]
    ends = [(r["tokens_seen"], r["tokens_seen"] / r["tokens_per_s"]) for r in recs if r.get("tokens_per_s")]
    if len(ends) < 2:
        raise EyasError(f"{metrics}: fewer than two training steps logged while measuring the machine")
    (n0, t0), (n1, t1) = ends[0], ends[-1]
    return (t1 - t0) / max(n1 - n0, 1)


def measure(target, stages, *, bench_dtype: str) -> Rates:
    """Time this machine on the stages' work (the module docstring); `stages` is eyas.run's Stages."""
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="eyas-sizing-"))
    try:  # the stages' own notes on scratch data (skipped records, the drafter's shape) would read as the run's
        with contextlib.redirect_stderr(io.StringIO()):
            return _measure(target, stages, root, bench_dtype, t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _measure(target, stages, root: Path, bench_dtype: str, t0: float) -> Rates:
    p, tr = stages.prepare, stages.train
    prompts, lengths, read_s = data_lengths(p, target, root)
    prompt_tokens, sample_tokens = statistics.fmean(prompts), statistics.fmean(lengths)
    regen_tokens = statistics.fmean(min(p.max_len, n + p.regen.max_new_tokens) for n in prompts)
    dtypes = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    shape = dict(prompt_len=max(1, round(prompt_tokens)), vocab=target.vocab_size)
    prefill_s, decode_s = _decode_rate(target.model, rows=p.regen.gen_batch or p.batch_size,
                                       dtype=dtypes[p.regen.regen_dtype], **shape)
    _, bench_s = _decode_rate(target.model, rows=1, dtype=dtypes[bench_dtype], **shape)
    lossless_s = bench_s if bench_dtype == "fp32" else _decode_rate(target.model, rows=1, dtype=torch.float32,
                                                                    **shape)[1]
    # capture and training on random tokens in the data's own lengths (so batches pad as the run's will): enough
    # for TRAIN_STEPS + 1 batches
    g = torch.Generator().manual_seed(1)
    samples, total = [], 0
    while total < (TRAIN_STEPS + 1) * tr.batch_tokens or len(samples) < 2:
        k = len(samples) % len(lengths)
        ids = torch.randint(0, target.vocab_size, (lengths[k],), generator=g).tolist()
        samples.append((f"size-{len(samples)}", ids, [0] * prompts[k] + [1] * (lengths[k] - prompts[k])))
        total += lengths[k]
    cap = stages.capture or CaptureConfig(out="", target=tr.target)
    cap = replace(cap, out=str(root / "store"), data=None, progress=False, overwrite=True, limit=None)
    capture_s = _timed(lambda: run_capture(cap, target, samples=samples)) / total
    cfg = replace(tr, store=str(root / "store"), data=None, out=str(root / "train"), steps=TRAIN_STEPS + 1,
                  epochs=None, resume=False, eval_fraction=0.0, eval_every=0, checkpoint_every=0, log_every=1,
                  progress=False, prefetch=False)
    Trainer(cfg, target).train()
    train_s = _train_rate(root / "train" / "metrics.jsonl")
    return Rates(read_s_per_conversation=read_s, prefill_s_per_token=prefill_s, decode_s_per_step=decode_s,
                 capture_s_per_token=capture_s, train_s_per_token=train_s, bench_s_per_token=bench_s,
                 lossless_s_per_token=lossless_s,
                 prompt_tokens=prompt_tokens, sample_tokens=sample_tokens, regen_tokens=regen_tokens,
                 seconds=time.perf_counter() - t0)


def estimate(stages, rates: Rates) -> dict[str, float]:
    """Predicted seconds of each stage of `stages` at `rates`. Upper bounds where the work varies: every reply runs
    to max_new_tokens, each bench round costs a plain decode step per token."""
    p, tr = stages.prepare, stages.train
    limit = p.limit or 0
    regen = min(limit, p.regen.regenerate_limit if p.regen.regenerate_limit is not None else limit) \
        if p.regenerate else 0
    rows = p.regen.gen_batch or p.batch_size
    new = p.regen.max_new_tokens
    out = {"prepare": limit * rates.read_s_per_conversation + regen * rates.prompt_tokens * rates.prefill_s_per_token
           + math.ceil(regen / rows) * new * rates.decode_s_per_step}
    tokens = regen * rates.regen_tokens + (limit - regen) * rates.sample_tokens
    if stages.capture is not None:
        out["capture"] = tokens * rates.capture_s_per_token
    epochs = tr.epochs if tr.epochs is not None else 1
    per_token = rates.train_s_per_token
    if tr.store is None:  # online: the target's forward in every step, at capture's rate
        per_token += rates.capture_s_per_token
    out["train"] = epochs * tokens * per_token  # the held-out share's evaluation counted as if it trained
    bench = 0.0
    for b in stages.bench.values():
        runs = 1 + (2 if b.baselines else 0)  # the drafter, plain and prompt lookup
        turns = (b.limit or 0) * (b.max_turns or 1)
        bench += turns * b.max_new_tokens * runs * rates.bench_s_per_token
        bench += min(b.lossless_turns, turns) * b.max_new_tokens * 2 * rates.lossless_s_per_token
    out["bench"] = bench
    return out


@dataclass(frozen=True)
class Plan:
    """What `choose` decided: the overrides that size the run, and the estimate they give."""

    scale: float
    overrides: dict
    """--set key -> its sized value (only those that changed)."""
    estimate: dict
    budget_s: float
    recipe: dict
    """--set key -> the recipe's value, for each key of overrides."""

    def to_dict(self) -> dict:
        return {"scale": round(self.scale, 4), "overrides": self.overrides, "recipe": self.recipe,
                "estimate_s": {k: round(v, 1) for k, v in self.estimate.items()}, "budget_s": self.budget_s}


def choose(stages, rates: Rates, budget_s: float, *, spent_s: float, fixed: set, bench_tables: int) -> Plan:
    """The largest scale <= 1 of the conversations and bench prompts whose estimate fits budget_s, less RESERVE and
    spent_s (the run's seconds so far: the target's load and the measuring), floored at MIN_CONVERSATIONS and
    MIN_BENCH_PROMPTS. `fixed`: the --set places (eyas.recipes.resolve_key) not to touch. bench_tables: the recipe's
    [[bench]] count; its prompts are scaled only where each table gave one bench, so that bench.N names the right
    table."""
    p = stages.prepare
    left = budget_s * (1 - RESERVE) - spent_s

    def sized(scale):
        ov = {}
        if ("prepare", "limit") not in fixed and p.limit:
            ov["prepare.limit"] = max(min(p.limit, MIN_CONVERSATIONS), round(p.limit * scale))
        if ("prepare", "regenerate_limit") not in fixed and p.regen.regenerate_limit:
            ov["prepare.regenerate_limit"] = max(1, round(p.regen.regenerate_limit * scale))
        regen = replace(p.regen, regenerate_limit=ov.get("prepare.regenerate_limit", p.regen.regenerate_limit))
        bench = {}
        for i, (name, b) in enumerate(stages.bench.items()):
            if len(stages.bench) == bench_tables and ("bench", i, "limit") not in fixed and b.limit:
                ov[f"bench.{i}.limit"] = max(min(b.limit, MIN_BENCH_PROMPTS), round(b.limit * scale))
                b = replace(b, limit=ov[f"bench.{i}.limit"])
            bench[name] = b
        prep = replace(p, limit=ov.get("prepare.limit", p.limit), regen=regen)
        return ov, replace(stages, prepare=prep, bench=bench)

    whole = estimate(stages, rates)
    if sum(whole.values()) <= left:
        return Plan(scale=1.0, overrides={}, estimate=whole, budget_s=budget_s, recipe={})
    lo, hi = 0.0, 1.0
    for _ in range(20):  # the estimate grows with the scale: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(estimate(sized(mid)[1], rates).values()) <= left else (lo, mid)
    ov, s = sized(lo)
    before = {"prepare.limit": p.limit, "prepare.regenerate_limit": p.regen.regenerate_limit,
              **{f"bench.{i}.limit": b.limit for i, b in enumerate(stages.bench.values())}}
    changed = {k: v for k, v in ov.items() if v != before[k]}
    return Plan(scale=lo, overrides=changed, estimate=estimate(s, rates), budget_s=budget_s,
                recipe={k: before[k] for k in changed})
