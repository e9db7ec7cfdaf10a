"""The target's prefill from a batch of prompts: plain decoding (target/generate.py) and every decoder in decode/
start here."""

from __future__ import annotations

import torch
from torch import Tensor


def right_padded(prompts: list[list[int]], device) -> tuple[Tensor, Tensor]:
    """Prompts as rows (B,T) from slot 0 (slot = RoPE position), zeros after each, and their lengths (B,)."""
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p, device=device)
    return ids, torch.tensor([len(p) for p in prompts], device=device)


def prefill(runner, prompts: list[list[int]], aux_ids: tuple[int, ...], chunk: int = 512):
    """Target cache rows 0..B-1 from the prompts (right-padded: `right_padded`), in causal chunks -> (each row's
    logits after its last prompt token (B,V), the captured aux states (B,T,len(aux_ids)*h), or None without aux ids).
    Every decoder prefills through here; batch 1 is one row.

    Prompts longest first (as `generate` orders them): a chunk runs only the rows whose prompt reaches it, a prefix
    of the batch, so short rows do not pay for the longest one's later chunks. Their cache slots past the prompt
    and their aux states there are then left unwritten (zeros in the aux states); decoding writes a slot before it
    reads it."""
    r, dev = runner, runner.device
    ids, lens = right_padded(prompts, dev)  # (B,T), (B,)
    B, T = ids.shape
    n_prompt = [len(p) for p in prompts]
    longest_first = all(a >= b for a, b in zip(n_prompt, n_prompt[1:]))
    final = torch.zeros(B, r.cfg.hidden_size, dtype=r.dtype, device=dev)  # final-norm state at slot n_b-1
    auxs = []
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        n = sum(k > s0 for k in n_prompt) if longest_first else B  # rows 0..n-1 reach this chunk
        q = torch.arange(s0, s1, device=dev)
        k = torch.arange(s1, device=dev)
        ln = lens[:n]
        # query s sees the row's prompt slots <= s; padding sees the prompt and itself (no empty rows)
        mask = ((k[None, None] <= q[None, :, None]) & (k[None, None] < ln[:, None, None])) \
            | (k[None, None] == q[None, :, None])  # (n,S,s1)
        h, cap = r.forward(ids[:n, s0:s1], q[None].expand(n, -1), q[None].expand(n, -1), mask,
                           capture=aux_ids, logits=False)  # (n,S,h)
        if aux_ids:
            a = torch.cat([cap[i] for i in aux_ids], -1)  # (n,S,3h_t)
            auxs.append(a if n == B else torch.cat([a, a.new_zeros(B - n, *a.shape[1:])]))
        here = (ln - 1 >= s0) & (ln - 1 < s1)  # (n,) the row's last prompt token is in this chunk
        rows = torch.arange(n, device=dev)
        final[:n] = torch.where(here[:, None], h[rows, (ln - 1 - s0).clamp(0, s1 - s0 - 1)], final[:n])
    return r.lm_head(final), (torch.cat(auxs, 1) if auxs else None)
