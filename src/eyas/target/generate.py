"""Plain batched decoding on the static-cache runner: prepare's regeneration, the bench's plain baseline.

Prompts run longest first in chunks of the runner's `max_batch` rows, each row from slot 0; a chunk prefills
(`target/prefill.py`, pieces of `prefill_chunk` tokens), then decodes one token per step (a CUDA graph per
(rows, window) shape on CUDA, or per row count when attending by lengths) until every row has met an eos or the
token budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from eyas.errors import EyasError
from eyas.target.prefill import prefill
from eyas.target.sampling import sample

if TYPE_CHECKING:
    from eyas.target.runner import Runner


@torch.no_grad()
def generate(runner: Runner, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, eos_ids=(), seed: int = 0, prefill_chunk: int = 512,
             progress=None, window: int = 256, compact: bool = True, lengths: bool | None = None
             ) -> list[list[int]]:
    """Plain batched decoding. Returns the new tokens of each prompt (ending at and including
    the first eos, or after max_new_tokens, or when the cache row is full).

    Prompts run longest first, `max_batch` rows per chunk. On CUDA each decode step is a CUDA graph that
    attends over the first L slots only, L = prompt + new tokens rounded up to `window` (0: all max_seq
    slots); every 16 steps, once half the rows have finished, the live rows are moved to the front of the
    cache and the step continues at the next power-of-two batch (`compact`), so a long tail of a few
    unfinished rows does not keep paying for the whole batch. Rows are independent: neither changes a
    row's tokens under greedy decoding.

    lengths: each decode step passes the rows' prefix lengths instead of a mask (`Runner.forward`), so
    attention reads only each row's own key/value blocks, not the chunk's whole window (`window` then bounds
    only compaction's copies). None: for batched decoding (max_batch > 1) on CUDA with an eager `Runner`, where it
    was measured
    (BENCHMARKS.md#eyas-run-gpu-preset-with-norm_before_fc-regeneration-by-lengths-the-tree-in-graph-rounds-issue-33--2026-12-04-0529-0545-utc);
    batch-1 runners keep their mask steps, and a compiled runner refuses steps by
    lengths (Runner.graphed says why)."""
    if temperature < 0:
        raise EyasError(f"temperature must be >= 0, got {temperature}")
    if not prompts:
        return []
    for i, p in enumerate(prompts):
        if not p:
            raise EyasError(f"generate: prompt {i} is empty")
        if len(p) >= runner.cfg.max_seq:
            raise EyasError(f"generate: prompt {i} has {len(p)} tokens, the cache holds {runner.cfg.max_seq}")
    if lengths is None:
        lengths = (getattr(runner, "attends_by_lengths", False) and runner.device.type == "cuda" and not runner.compiled
                   and runner.cfg.max_batch > 1)
    elif lengths and not getattr(runner, "attends_by_lengths", False):
        raise EyasError(f"generate: attention by lengths needs the Llama runner, not {type(runner).__name__}")
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=runner.device)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    B = runner.cfg.max_batch
    for c in range(0, len(order), B):
        idx = order[c:c + B]
        rows = _generate_chunk(runner, [prompts[i] for i in idx], max_new_tokens, temperature, top_p, eos,
                               gen, prefill_chunk, window, compact, lengths)
        for i, r in zip(idx, rows):
            out[i] = r
        if progress is not None:
            progress(len(idx))
    return out


def _pick(logits: Tensor, temperature: float, top_p: float, gen) -> Tensor:
    """sample(): greedy as max(-1).indices, argmax's first-index rule, which is several times faster than argmax
    over a bf16 vocabulary on the CPU."""
    return logits.max(-1).indices if temperature == 0 else sample(logits, temperature, top_p, gen)


def _generate_chunk(runner: Runner, prompts, max_new, temperature, top_p, eos, gen, prefill_chunk, window, compact,
                    lengths):
    dev, M = runner.device, runner.cfg.max_seq
    B = len(prompts)
    logits, _ = prefill(runner, prompts, (), prefill_chunk)  # (B,V): rows from slot 0, right-padded
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    T = int(lens.max())
    steps = min(max_new, M - T)
    # slots the decode steps can reach: up to T + steps - 1 (the last token is sampled, never fed)
    W = min(M, -(-(T + steps) // window) * window) if window else M
    tokens = torch.zeros(B, max(steps, 1), dtype=torch.long, device=dev)  # by original row
    nxt = _pick(logits, temperature, top_p, gen)  # (B,)
    valid = torch.arange(W, device=dev)[None] < lens[:, None]  # (B,W) the row's prompt slots
    pos = lens[:, None].clone()  # (B,1) slot = RoPE position of the token fed next
    slot = pos.clone()
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    rows = torch.arange(B, device=dev)  # original row of each cache row
    n = m = B  # cache rows in use; the first m of them are real rows (the rest fill a graph size)
    step = runner.graphed(n, 1, lengths=True) if lengths else runner.graphed(n, 1, slots=W)
    cuda = dev.type == "cuda"
    flags = torch.zeros(2, dtype=torch.bool, pin_memory=cuda)  # "every row done", copied to the host each step
    events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else []  # each marks its flag's copy
    pending = None  # the flag index of the previous step's copy
    for t in range(steps):
        tokens[rows[:m], t] = nxt[:m]
        done |= torch.isin(nxt, eos)
        if t + 1 == steps:
            break
        # Stop once every row has met an eos. On CUDA the flag is read one step late: the wait is for the copy
        # queued before the previous forward, so that forward still runs while this step is queued (no bubble);
        # at most one step is spent after the last eos, where a check every 16 steps spent up to 15.
        if not cuda:
            if bool(done.all()):
                break
        else:
            if pending is not None:
                events[pending].synchronize()
                if bool(flags[pending]):
                    break
            pending = t % 2
            flags[pending].copy_(done.all(), non_blocking=True)
            events[pending].record()
        if t % 16 == 15 and n > 1:  # compaction (one row: nothing to compact, the flag above stops it)
            live = (~done).nonzero().flatten()
            k = live.numel()  # one host sync per 16 steps
            if k == 0:
                break
            if compact and k <= n // 2:
                n, m = 1 << (k - 1).bit_length(), k  # a few graph sizes, not one per count
                keep = torch.cat([live, live[:1].expand(n - k)])  # filler rows: copies of a live row
                runner.move_rows(keep, W)
                nxt, pos, slot, valid, rows = nxt[keep], pos[keep], slot[keep], valid[keep], rows[keep]
                done = torch.zeros(n, dtype=torch.bool, device=dev)
                done[k:] = True  # fillers: their tokens are never read and they never hold up the chunk
                step = runner.graphed(n, 1, lengths=True) if lengths else runner.graphed(n, 1, slots=W)
        if lengths:  # the row's prompt and its fed tokens: slots 0..slot
            lg = step(nxt[:, None], pos, slot, slot[:, 0] + 1)
        else:
            valid.scatter_(1, slot, True)  # each row's fed token (slot lens_b + t)
            # A CUDA graph needs the full static mask; eagerly, attend only over the slots in use.
            L = W if dev.type == "cuda" else T + t + 1
            lg = step(nxt[:, None], pos, slot, valid[:, None, :L])
        nxt = _pick(lg[:, -1], temperature, top_p, gen)
        pos += 1
        slot += 1
    res = []
    eos_set = set(eos.tolist())
    for row in tokens[:, :steps].tolist():
        cut = next((i + 1 for i, tok in enumerate(row) if tok in eos_set), len(row))
        res.append(row[:cut])
    return res
