"""Batched speculative decoding: greedy EAGLE-3 chains for B prompts at once, each row accepting its own length.

Cache row b of the target runner holds one prompt from slot 0 (right padding, so slot = RoPE position):
slots 0..n_b-1 hold processed tokens and the row's last emitted token is pending. One round, for all rows:
- the drafter proposes K tokens per row (its static cache has one row per target row, entry t at slot t);
- ONE target forward runs [pending, d_1..d_K] of every row at slots n_b..n_b+K, each row attending only
  its own slots 0..n_b+s, and captures the aux states;
- greedy acceptance per row (`accept`): the longest prefix with d_j == target argmax, plus the bonus token
  from the same logits. A chain's accepted slots already follow the prefix; rejected ones lie beyond the
  new n_b, are masked and are overwritten next round;
- the drafter's cache gets, per row, the accepted positions' aux states paired with the accepted tokens
  and the bonus (exactly what `eagle.EagleDrafting.extend` does at batch 1).

A row that finishes (eos or max_new_tokens) rides along with n_b = 0: its dummy rounds write slots 0..K
of its own row only. Once at most half the rows are live, the live rows move to the front of both caches
and the batch shrinks to the next power of two (filler rows are finished copies), like
`Runner.generate` (both move the target's rows with the runner's `move_rows`).

On CUDA the drafter's propose and extend attend all cache slots, so their shapes depend on the batch only, and
each runs as one CUDA graph per batch size, as the verify does; the host syncs once per round.

Greedy only: every row's output equals the target's greedy output of that prompt alone, and its per-round
acceptance counts equal the batch-1 chain decoder's (tests/test_batch_chains.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.decode.cache import DraftCache
from eyas.decode.common import SpecStats, accept, fit_drafter, prefill, right_padded
from eyas.errors import EyasError


@dataclass(frozen=True, kw_only=True)
class BatchSpecConfig:
    k: int = 5
    """Draft tokens per row and round (chain length)."""
    temperature: float = 0.0
    """Only 0 (greedy) is implemented for batches; sampling runs at batch 1 (`SpecDecoder`)."""
    compact: bool = True
    """Move the live rows to the front of the caches once at most half the batch is live."""
    prefill_chunk: int = 512
    """Prompt tokens per prefill forward."""

    def __post_init__(self):
        if self.k < 1:
            raise EyasError(f"batched chains need k >= 1 draft tokens, got {self.k}")
        if self.temperature < 0:
            raise EyasError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > 0:
            raise EyasError("batched speculative decoding is greedy only: temperature > 0 is not implemented "
                            "for batch > 1 (use SpecDecoder, which samples losslessly at batch 1)")
        if self.prefill_chunk < 1:
            raise EyasError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


class BatchChainDecoder:
    """Greedy EAGLE-3 chains for a batch of prompts on a target `Runner` (rows 0..max_batch-1)."""

    def __init__(self, runner, drafter, cfg: BatchSpecConfig = BatchSpecConfig(), *, graphs: bool | None = None):
        """graphs (default: on CUDA): the drafter's propose and extend attend all cache slots (shapes that depend
        on the batch only) and run as one CUDA graph each per batch size, like the verify step."""
        if drafter is None:
            raise EyasError("batched chains need a drafter")
        if cfg.k + 2 > runner.cfg.max_seq:
            raise EyasError(f"a draft of {cfg.k} tokens does not fit a target cache of {runner.cfg.max_seq} slots")
        self.runner, self.cfg = runner, cfg
        drafter = fit_drafter(runner, drafter)
        self.aux_ids = tuple(drafter.config.aux_layer_ids)
        self.graphs = runner.device.type == "cuda" if graphs is None else graphs
        self.drafting = DraftCache(drafter, runner.embed, rows=runner.cfg.max_batch, slots=runner.cfg.max_seq,
                                   k=cfg.k, graphs=self.graphs)
        self._verify_fn = runner.step_fn(self.aux_ids)  # compiled when the runner is

    def _propose(self, n: Tensor, width: int) -> Tensor:
        """(B,K) drafts from committed counts n (B,); with graphs, a replay over all slots (the warm-up calls run
        for real: they write draft keys past each row's n only)."""
        self.drafting.n[:n.shape[0]] = n
        return self.drafting.draft_chain(n.shape[0], None if self.graphs else width)

    def _extend(self, aux: Tensor, tokens: Tensor, count: Tensor, width: int) -> None:
        """The round's drafter entries, count_b of them in row b from the n `_propose` set; with graphs, a replay
        over all slots."""
        self.drafting.extend(aux, tokens, count, None if self.graphs else width)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, eos_ids=()
                 ) -> tuple[list[list[int]], list[SpecStats]]:
        """New tokens of each prompt (ending at and including the first eos, or after max_new_tokens) and
        each row's stats (target_forwards counts the verify forwards the row took part in while live, plus
        its prefill). Prompts run longest first, max_batch rows at a time."""
        M, K = self.runner.cfg.max_seq, self.cfg.k
        if max_new_tokens < 1:
            raise EyasError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not p:
                raise EyasError(f"batched speculative decoding: prompt {i} is empty")
            if len(p) + max_new_tokens + K + 1 > M:
                raise EyasError(f"prompt {i}: {len(p)} tokens + {max_new_tokens} new + {K} draft tokens exceed "
                                f"the target cache ({M} slots)")
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        outs: list[list[int]] = [[] for _ in prompts]
        stats: list[SpecStats] = [SpecStats() for _ in prompts]
        B = self.runner.cfg.max_batch
        for c in range(0, len(order), B):
            idx = order[c:c + B]
            o, s = self._generate_chunk([prompts[i] for i in idx], max_new_tokens, set(eos_ids))
            for j, i in enumerate(idx):
                outs[i], stats[i] = o[j], s[j]
        return outs, stats

    def _prefill(self, prompts: list[list[int]]) -> Tensor:
        """Prefill target and drafter rows 0..B-1 (right-padded); returns the first new token of each row (B,)."""
        c, dev = self.cfg, self.runner.device
        logits, aux = prefill(self.runner, prompts, self.aux_ids, c.prefill_chunk)  # (B,V), (B,T,3h_t)
        first = logits.argmax(-1)  # (B,)
        ids, lens = right_padded(prompts, dev)  # (B,T), (B,)
        T, rows = ids.shape[1], torch.arange(len(prompts), device=dev)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # (B,T) x_{t+1}; padding beyond
        nxt[rows, lens - 1] = first
        self.drafting.n.zero_()
        for s0 in range(0, T, c.prefill_chunk):
            s1 = min(T, s0 + c.prefill_chunk)
            count = (lens.clamp(max=s1) - s0).clamp(min=0)  # (B,) prompt entries of row b in this chunk
            self.drafting.extend(aux[:, s0:s1], nxt[:, s0:s1], count, width=s0)  # n_b = min(len_b, s0) before
        return first

    def _move_rows(self, keep: Tensor, width: int) -> None:
        """Target and drafter cache rows `keep` (slots [:width]) become rows 0..len(keep)-1."""
        self.runner.move_rows(keep, width)
        self.drafting.move_rows(keep, width)

    def _generate_chunk(self, prompts, max_new: int, eos: set[int]):
        r, K, dev, M = self.runner, self.cfg.k, self.runner.device, self.runner.cfg.max_seq
        S = K + 1
        pending = self._prefill(prompts)  # (B,)
        out = [[t] for t in pending.tolist()]
        stats = [SpecStats(target_forwards=1, accepted_at=[0] * K) for _ in prompts]
        done = [o[0] in eos or max_new <= 1 for o in out]
        # per cache row: the prompt it decodes (-1: a filler row) and its committed slots (0 once finished)
        rows = list(range(len(prompts)))
        n = [0 if done[b] else len(p) for b, p in enumerate(prompts)]
        ar = torch.arange(S, device=dev)
        cols = torch.arange(M, device=dev)
        while True:
            live = [i for i, b in enumerate(rows) if b >= 0 and not done[b]]
            if not live:
                break
            if self.cfg.compact and len(live) <= len(rows) // 2:
                m = 1 << (len(live) - 1).bit_length()  # a few batch sizes (CUDA graphs), not one per count
                keep = live + [live[0]] * (m - len(live))
                self._move_rows(torch.tensor(keep, device=dev), max(n[i] for i in live))
                pending = pending[torch.tensor(keep, device=dev)]
                rows = [rows[i] for i in live] + [-1] * (m - len(live))
                n = [n[i] for i in live] + [0] * (m - len(live))
                live = list(range(len(live)))
            assert max(n) + S <= M, "a live row outgrew its checked cache bound"
            n_t = torch.tensor(n, device=dev)  # (B,)
            draft = self._propose(n_t, max(n) + K - 1)  # (B,K)
            ids = torch.cat([pending[:, None], draft], 1)  # (B,S)
            slots = n_t[:, None] + ar  # (B,S) slot = RoPE position
            W = M if dev.type == "cuda" or self.graphs else max(n) + S  # a CUDA graph needs the full static mask
            mask = cols[:W][None, None] <= slots[:, :, None]  # (B,S,W) the row's own prefix, causal
            logits, vaux = r.graphed(len(rows), S, self._verify_fn)(ids, slots, slots, mask)
            acc, bonus = accept(draft, logits.argmax(-1))  # (B,), (B,)
            new = torch.cat([draft, bonus[:, None]], 1).scatter(1, acc[:, None], bonus[:, None])  # (B,S) 0..acc
            is_live = torch.zeros(len(rows), dtype=torch.bool, device=dev)
            is_live[live] = True
            count = torch.where(is_live, acc + 1, 0)  # (B,) entries the drafter gains per row
            self._extend(vaux, new, count, max(n))
            pending = bonus
            acc_l, new_l = acc.tolist(), new.tolist()  # the round's one host sync
            for i in live:
                b, a = rows[i], acc_l[i]
                toks = new_l[i][:a + 1]
                stats[b].add_round(a)
                out[b] += toks
                n[i] += a + 1
                if len(out[b]) >= max_new or any(t in eos for t in toks):
                    done[b] = True
                    n[i] = 0  # its dummy rounds now write slots 0..K of its own row
        return [st.finish(o, eos, max_new) for o, st in zip(out, stats)], stats
