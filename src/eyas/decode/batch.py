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
`Runner.generate` (both move the target's rows with `target.runner.move_rows`).

On CUDA the drafter's propose and extend attend all cache slots, so their shapes depend on the batch only, and
each runs as one CUDA graph per batch size, as the verify does; the host syncs once per round.

Greedy only: every row's output equals the target's greedy output of that prompt alone, and its per-round
acceptance counts equal the batch-1 chain decoder's (tests/test_batch_spec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.decode.common import SpecStats, accept, fit_drafter
from eyas.errors import EyasError
from eyas.target.graphs import capture
from eyas.target.runner import move_rows


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


class BatchChainDrafting:
    """The drafter's static cache for `rows` rows of `slots` slots; row b holds entries 0..n_b-1.

    Entry t pairs fc(aux_t) with the embedding of x_{t+1}, sits in slot t at RoPE position t and predicts
    x_{t+2} (EAGLE3.md section 3). Every call passes the first `width` slots as the past plus a mask over
    them, then writes the new keys at their slots; slots at or past n_b are draft or padding keys, never
    attended until they are overwritten."""

    def __init__(self, drafter, embed, rows: int, slots: int):
        self.d, self.embed = drafter, embed  # embed: the frozen target embedding
        cfg = drafter.config
        p = next(drafter.parameters())
        shape = (rows, cfg.num_key_value_heads, slots, cfg.head_dim)
        self.k = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.v = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.last = torch.zeros(rows, 1, cfg.hidden_size, device=p.device, dtype=p.dtype)  # output of entry n_b-1
        self.cols = torch.arange(slots, device=p.device)

    def _layer(self, hidden: Tensor, tokens: Tensor, pos: Tensor, old: Tensor) -> Tensor:
        """New entries (B,S) at slots = RoPE positions `pos` (B,S); `old` (B,S,W) marks the cached slots
        0..W-1 each one attends; new entries attend earlier new entries and themselves."""
        B, S = tokens.shape
        W = old.shape[-1]
        tri = torch.ones(S, S, dtype=torch.bool, device=pos.device).tril()[None].expand(B, S, S)  # (B,S,S)
        mask = torch.cat([old, tri], -1)  # (B,S,W+S)
        out, (k, v) = self.d.layer(hidden, self.embed(tokens), pos, mask, (self.k[:B, :, :W], self.v[:B, :, :W]))
        rows = torch.arange(B, device=pos.device)[:, None].expand(B, S)  # (B,S)
        self.k[rows, :, pos] = k[:, :, W:].transpose(1, 2)  # cache[b, :, pos[b,s]] = k_new[b, :, s]
        self.v[rows, :, pos] = v[:, :, W:].transpose(1, 2)
        return out  # (B,S,h)

    @torch.no_grad()
    def extend(self, aux: Tensor, next_tokens: Tensor, n: Tensor, count: Tensor, W: int) -> None:
        """Append count_b entries to row b at slots n_b..: aux (B,S,3h_t), next_tokens (B,S); entries
        s >= count_b are padding. W >= max(n): cached slots passed as the past. The caller advances n."""
        B, S = next_tokens.shape
        pos = n[:, None] + torch.arange(S, device=n.device)  # (B,S)
        old = (self.cols[:W][None, None] < n[:, None, None]).expand(B, S, W)  # (B,S,W) committed slots
        out = self._layer(self.d.fuse(aux), next_tokens, pos, old)  # (B,S,h)
        last = out[torch.arange(B, device=n.device), (count - 1).clamp(min=0)][:, None]  # (B,1,h)
        self.last[:B] = torch.where((count > 0)[:, None, None], last, self.last[:B])

    @torch.no_grad()
    def propose(self, n: Tensor, K: int, W: int) -> Tensor:
        """K greedy draft tokens per row (B,K) target ids; step j runs at slot/position n_b + j - 1.
        W >= max(n) + K - 2: cached slots passed as the past."""
        B, d = n.shape[0], self.d
        hidden = self.last[:B]  # (B,1,h)
        toks = []
        for step in range(K):
            toks.append(d.draft_to_target(d.logits(hidden)[:, -1].argmax(-1)))  # (B,)
            if step + 1 == K:
                break
            pos = (n + step)[:, None]  # (B,1) entry n_b-1 + (step+1)
            old = (self.cols[:W][None] < pos)[:, None]  # (B,1,W) committed + earlier draft entries
            hidden = self._layer(hidden, toks[-1][:, None], pos, old)
        return torch.stack(toks, 1)  # (B,K)

    def move_rows(self, keep: Tensor, width: int) -> None:
        """Rows `keep` (1-D) of slots [:width] become rows 0..len(keep)-1."""
        m = keep.numel()
        self.k[:m, :, :width] = self.k[keep, :, :width]
        self.v[:m, :, :width] = self.v[keep, :, :width]
        self.last[:m] = self.last[keep]


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
        self.drafting = BatchChainDrafting(drafter, runner.embed, runner.cfg.max_batch, runner.cfg.max_seq)
        self._verify_fn = runner.step_fn(self.aux_ids)  # compiled when the runner is
        self.graphs = runner.device.type == "cuda" if graphs is None else graphs
        self._graphs: dict = {}

    def _propose(self, n: Tensor, width: int) -> Tensor:
        """(B,K) drafts; with graphs, a replay over all slots."""
        K, M = self.cfg.k, self.runner.cfg.max_seq
        if not self.graphs:
            return self.drafting.propose(n, K, width)
        key = ("propose", n.shape[0])
        if key not in self._graphs:
            n_s = n.clone()  # the warm-up calls run for real: they write draft keys past each row's n only
            self._graphs[key] = (capture(self.drafting.propose, n_s, K, M, cuda=n.is_cuda), n_s)
        run, n_s = self._graphs[key]
        n_s.copy_(n)
        return run()

    def _extend(self, aux: Tensor, tokens: Tensor, n: Tensor, count: Tensor, width: int) -> None:
        """The round's drafter entries; with graphs, a replay over all slots (extend is idempotent for fixed
        inputs: it reads slots < n and writes slots >= n, so the warm-up calls change nothing)."""
        if not self.graphs:
            return self.drafting.extend(aux, tokens, n, count, width)
        key = ("extend", n.shape[0])
        if key not in self._graphs:
            bufs = (aux.clone(), tokens.clone(), n.clone(), count.clone())
            self._graphs[key] = (capture(self.drafting.extend, *bufs, self.runner.cfg.max_seq, cuda=n.is_cuda), bufs)
        run, bufs = self._graphs[key]
        for b, x in zip(bufs, (aux, tokens, n, count)):
            b.copy_(x)
        run()

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
        r, c, dev = self.runner, self.cfg, self.runner.device
        B, T = len(prompts), max(map(len, prompts))
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # (B,)
        ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p, device=dev)
        rows = torch.arange(B, device=dev)
        final = torch.zeros(B, r.cfg.hidden_size, dtype=r.dtype, device=dev)  # final-norm state at slot n_b-1
        auxs = []
        for s0 in range(0, T, c.prefill_chunk):
            s1 = min(T, s0 + c.prefill_chunk)
            q = torch.arange(s0, s1, device=dev)
            k = torch.arange(s1, device=dev)
            # query s sees the row's prompt slots <= s; padding sees the prompt and itself (no empty rows)
            mask = ((k[None, None] <= q[None, :, None]) & (k[None, None] < lens[:, None, None])) \
                | (k[None, None] == q[None, :, None])  # (B,S,s1)
            h, cap = r.forward(ids[:, s0:s1], q[None].expand(B, -1), q[None].expand(B, -1), mask,
                               capture=self.aux_ids, logits=False)  # (B,S,h)
            auxs.append(torch.cat([cap[i] for i in self.aux_ids], -1))  # (B,S,3h_t)
            here = (lens - 1 >= s0) & (lens - 1 < s1)  # (B,) the row's last prompt token is in this chunk
            final = torch.where(here[:, None], h[rows, (lens - 1 - s0).clamp(0, s1 - s0 - 1)], final)
        first = r.lm_head(final).argmax(-1)  # (B,)
        aux = torch.cat(auxs, 1)  # (B,T,3h_t)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # (B,T) x_{t+1}; padding beyond
        nxt[rows, lens - 1] = first
        for s0 in range(0, T, c.prefill_chunk):
            s1 = min(T, s0 + c.prefill_chunk)
            n = lens.clamp(max=s0)  # entries already in row b
            count = (lens.clamp(max=s1) - s0).clamp(min=0)  # (B,) prompt entries of row b in this chunk
            self.drafting.extend(aux[:, s0:s1], nxt[:, s0:s1], n, count, s0)
        return first

    def _move_rows(self, keep: Tensor, width: int) -> None:
        """Target and drafter cache rows `keep` (slots [:width]) become rows 0..len(keep)-1."""
        move_rows(self.runner, keep, width)
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
            self._extend(vaux, new, n_t, count, max(n))
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
