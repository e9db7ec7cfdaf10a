"""Bench start-up: a persistent compile cache (target/compile.py compile_cache), and warm-up on a fixed set of shapes.

A bench process pays for loading, dynamo tracing, inductor compilation and CUDA-graph capture before it
decodes anything. Inductor's FX graph cache (and the Triton kernels under it) survives the process when
it lives in a directory that is kept: `$EYAS_CACHE/inductor`, unless the user pointed
TORCHINDUCTOR_CACHE_DIR elsewhere. Tracing and graph capture are per process; they are done up front, on
every shape the timed loop will use, so that nothing compiles or captures while the clock runs.
"""

from __future__ import annotations

import torch

from eyas.target.compile import compile_cache  # noqa: F401 (the bench's start-up uses it; training too)
from eyas.target.persist import PersistentStep


def saved_steps(runner) -> dict:
    """Totals over a runner's saved compiled steps (target/persist.py PersistentStep; none without persist): files
    loaded, steps compiled and saved, plain-compile fallbacks."""
    steps = [s for s in (getattr(runner, "_compiled", None), *getattr(runner, "_step_fns", {}).values())
             if isinstance(s, PersistentStep)]
    return {k: sum(getattr(s, k) for s in steps) for k in ("loaded", "compiled", "fallbacks")}


def tree_nodes(top_k: int, depth: int, total: int, draft_vocab: int) -> int:
    """Draft nodes of an EAGLE-2 tree round (eagle.EagleDrafting.propose_tree): min(total, pool size)."""
    f = min(top_k, draft_vocab)
    pool = f
    for _ in range(2, depth + 1):
        n = f * min(top_k, draft_vocab)
        pool += n
        f = min(top_k, n)
    return min(total, pool)


def verify_shapes(method: str, k: int, tree_size: int) -> list[int]:
    """Token counts S of the target forwards a decoding method issues per round (root + draft)."""
    if method == "plain":
        return [1]
    if method == "lookup":
        return [k + 1]  # 1..K drafts padded to K+1 rows; an empty draft: S = 1 (SpecDecoder.step_for)
    if method == "chain":
        return [k + 1]
    return [tree_size + 1]


@torch.no_grad()
def warm_up(runner, step_fns: list[tuple], drafters=()) -> int:
    """Compile and capture every (fn, S) in `step_fns` ((fn, [S...]); fn None = the runner's plain decode
    step) and the drafter cache extends of 1..K+1 entries, on the slot convention of Runner.graphed (only
    slot max_seq-1 is written, never a live one). Returns how many runner shapes exist afterwards."""

    M, dev = runner.cfg.max_seq, runner.device
    for fn, sizes in step_fns:
        for S in sizes:
            ids = torch.zeros(1, S, dtype=torch.long, device=dev)
            slots = torch.full((1, S), M - 1, dtype=torch.long, device=dev)
            mask = torch.zeros(1, S, M, dtype=torch.bool, device=dev)
            mask[..., -1] = True
            runner.graphed(1, S, fn)(ids, ids, slots, mask)
    for drafting, width, K in drafters:  # graphed chain drafters capture one extend graph per length
        for S in range(1, K + 2):
            drafting.reset()
            drafting.extend(torch.zeros(1, S, width, dtype=runner.dtype, device=dev),
                            torch.zeros(1, S, dtype=torch.long, device=dev))
        drafting.reset()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return runner.graph_count
