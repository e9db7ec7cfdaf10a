"""The bench's two greedy checks against plain decoding: agreement in the bench's dtype, and the exact
lossless check in fp32.

In bf16 a verify forward over S tokens rounds differently from S one-token steps, so a near-tie can flip
an argmax and a lossless decoder still drifts from plain greedy. Equality there is a statistic
(`agreement`), not a pass/fail. Exactness is checked where it holds: the first few turns are decoded
again in fp32 (`fp32_rerun`), where speculative output must equal plain greedy token for token.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from eyas.target.runner import Runner

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: list[list[list[int]]], reference: list[list[list[int]]]) -> dict:
    """Token agreement of `outputs` with `reference` (both: per record, per turn, the new tokens).

    identical_turns: turns equal token for token; mean_prefix_tokens: mean over turns of the identical
    prefix length; mean_prefix_share: mean over turns of that prefix over the longer of the two turns
    (1.0 for an identical turn). Multi-turn records are answered with each method's own earlier answers,
    so after a divergence the later turns of that record start from different contexts.
    """
    pairs = [(a, b) for x, y in zip(outputs, reference, strict=True) for a, b in zip(x, y, strict=True)]
    prefix = [common_prefix(a, b) for a, b in pairs]
    share = [p / max(len(a), len(b), 1) for p, (a, b) in zip(prefix, pairs)]
    n = len(pairs)
    return {"turns": n, "identical_turns": sum(a == b for a, b in pairs),
            "identical_share": round(sum(a == b for a, b in pairs) / n, 4) if n else None,
            "mean_prefix_tokens": round(sum(prefix) / n, 2) if n else None,
            "mean_prefix_share": round(sum(share) / n, 4) if n else None,
            "prefix_by_turn": prefix}


def first_turns(records: list[dict], n: int) -> list[dict]:
    """The first n turns of the bench, in bench order (whole records first, the last one cut)."""
    out, left = [], n
    for r in records:
        if left <= 0:
            break
        out.append({**r, "turns": r["turns"][:left]})
        left -= len(out[-1]["turns"])
    return out


_PRECISION_KNOBS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                    "mkldnn.rnn")
"""torch.backends paths with an `fp32_precision` (torch >= 2.9), which the older switches below write through."""


def _precision_state() -> list[tuple[object, str]]:
    state = []
    for path in _PRECISION_KNOBS:
        obj = torch.backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            state.append((obj, obj.fp32_precision))
    return state


@contextmanager
def exact_fp32():
    """fp32 matmuls without TF32 for the duration, every switch restored after: `set_float32_matmul_precision`
    also writes the newer `fp32_precision` fields ('none' becomes 'ieee'), which inductor's FX-graph cache keys
    read, so leaving them changed would make every later compile in the process miss the caches a warm-up filled."""
    prec = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    fields = _precision_state()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prec)
        torch.backends.cudnn.allow_tf32 = cudnn
        for obj, value in fields:
            obj.fp32_precision = value


def fp32_runner(runner, model, cache: dict, key):
    """`runner` itself when it already runs in fp32, else an fp32 runner built from the same HF weights
    (an exact upcast), cached in `cache` under `key` so repeated benches build it once."""
    if runner.dtype == torch.float32:
        return runner
    if key not in cache:
        cache[key] = Runner.from_hf(model, max_batch=1, max_seq=runner.cfg.max_seq, device=runner.device,
                                    dtype=torch.float32, compile=False)
    return cache[key]


def fp32_drafter(drafter):
    """An fp32 copy: SpecDecoder moves its drafter to the runner's dtype in place, and the caller's
    drafter must stay as it was for the next bench."""
    return None if drafter is None else copy.deepcopy(drafter).float()


def lossless_verdict(outputs: dict[str, list], plain: list, *, dtype: torch.dtype, rerun: bool) -> dict:
    """Per method: held (every turn equal to plain greedy), identical_turns, turns, dtype, rerun."""
    res = {}
    for name, outs in outputs.items():
        a = agreement(outs, plain)
        res[name] = {"held": a["identical_turns"] == a["turns"], "identical_turns": a["identical_turns"],
                     "turns": a["turns"], "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "rerun": rerun}
    return res
