"""A greedy round as ONE CUDA graph, for EAGLE-3 chains, EAGLE-2 trees and DFlash blocks: propose, verify, accept,
commit.

Batch 1 (cache row 0 of the target runner); the tokens and per-round accepted counts of `SpecDecoder`'s greedy
chains and static trees (tests/test_graph_round_chain.py, tests/test_graph_round_tree.py). A round's state lives in static device
buffers: the committed count `n` (target cache slots 0..n-1 = drafter entries 0..n-1), the pending token (emitted,
not yet run through the target) and the drafter's static cache (`cache.DraftCache`). The two round bodies:
- chain: K greedy drafts, draft step j at position n+j-1; ONE target forward of [pending, d_1..d_K] at slots
  n..n+K (slot = RoPE position), slot n+s attending slots 0..n+s, capturing the drafter's aux layers; accept
  (`common.accept`) the longest prefix with d_j == target argmax and the bonus token from the same logits. The
  accepted slots n..n+a are already in place; the rest lie past the new n, masked, overwritten next round.
- tree: the cache's tree of S nodes (node 0 = the pending token); ONE target forward of the S nodes at slots
  n..n+S-1, positions n + depth, node i attending the committed slots and its ancestors (and itself). Node i >= 1
  matches when its token is the target's argmax at its parent and is accepted when it and every ancestor match;
  a node's children carry distinct tokens, so the accepted nodes are one path from the root (`tree.verify`'s greedy
  walk). Its deepest node b, at depth a, gives a drafts and the bonus argmax(b). The path's target k/v move from
  slots n + path[j] to n + j. Fixed shapes: the path is P = min(depth+1, S) node indices, the ancestors of b in
  index order (depth order) followed by filler whose writes lie past the new n.
Both then commit: the drafter writes entries at n.. for the verify's aux states of the path paired with the next
tokens (accepted drafts, then the bonus); the first a+1 count, and n += a+1.
A DFlash drafter (dflash.py's DFlashDrafting) runs the chain body: its K drafts are the block [pending, MASK..] at
positions n..n+B-1 over the context entries 0..n-1, one forward; its commit writes the verify's aux states of
[pending, d_1..d_K] as context entries n..n+K (a DFlash entry is the feature alone), of which the first a+1 count.

On CUDA the round is captured once per decoder and replayed; nothing in it waits for the host. The host learns a
round's accepted count and tokens from an async copy into pinned memory that it reads one round late: round r+1 is
launched before the host waits for round r, so the device does not idle between rounds. A round launched after
the stop is thrown away (it only writes past the committed slots). Near the end of the cache the host waits for
round r before it launches round r+1, so a launched round never writes past the cache. On the CPU the same code
runs eagerly (no graph, the same late reads). Stopping: at the round whose tokens contain an eos or reach
max_new_tokens, like `SpecDecoder` and `decode/batch.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.decode.cache import DraftCache
from eyas.decode.common import SpecConfig, SpecStats, accept, fit_drafter, prefill
from eyas.decode.dflash import DFlashDrafting, check_spec, is_dflash
from eyas.errors import EyasError
from eyas.target.graphs import capture

WARMUP = 3
"""Eager calls of the round before it is captured (lazy allocations, cuBLAS handles, compilation; as the runner)."""


class RoundDecoder:
    """Greedy EAGLE-3 chains, EAGLE-2 trees or DFlash blocks on a target `Runner` (batch 1, cache row 0), each round
    one CUDA graph on CUDA."""

    def __init__(self, runner, drafter, cfg: SpecConfig = SpecConfig(), *, compile_drafter: bool = False):
        """compile_drafter: torch.compile the drafter's part of the round (cache.DraftCache's bodies; a DFlash
        block runs uncompiled inside the graph)."""
        if cfg.method not in ("chain", "tree") or cfg.temperature != 0:
            raise EyasError(f"the one-graph round runs greedy chains and trees only (method chain or tree, "
                            f"temperature 0), got method {cfg.method!r}, temperature {cfg.temperature}")
        if drafter is None:
            raise EyasError(f"decode method {cfg.method!r} needs a drafter")
        M, dev = runner.cfg.max_seq, runner.device
        drafter = fit_drafter(runner, drafter)
        if is_dflash(drafter):
            check_spec(cfg, drafter)  # chains of k <= B-1 only
        if cfg.method == "chain":
            K = cfg.k
            if K + 2 > M:
                raise EyasError(f"a draft of {K} tokens does not fit a target cache of {M} slots")
            d = (DFlashDrafting(drafter, runner.embed, runner.lm_head, slots=M, k=K) if is_dflash(drafter)
                 else DraftCache(drafter, runner.embed, slots=M, k=K, compile=compile_drafter))
            S = P = K + 1  # verified nodes, longest accepted path (root included)
            self._body = self._chain_round
        else:
            d = DraftCache(drafter, runner.embed, slots=M, tree=(cfg.top_k, cfg.depth, cfg.total_tokens),
                           compile=compile_drafter)
            S = 1 + min(cfg.total_tokens, d.pool_depths.numel())  # the root and the kept draft nodes
            if S + 1 > M:
                raise EyasError(f"a tree of {S - 1} draft nodes does not fit a target cache of {M} slots")
            P = min(cfg.depth + 1, S)
            self._body = self._tree_round
        # K: most drafts a round accepts; width: target slots a round writes from the committed count
        self.runner, self.cfg, self.drafting, self.K, self.width, self.S, self.P = runner, cfg, d, P - 1, S, S, P
        self.aux_ids = tuple(drafter.config.aux_layer_ids)
        self._verify = runner.step_fn(self.aux_ids)  # compiled when the runner is
        self.pending = d.root  # the pending token; a tree proposer reads it from there
        self.info = torch.zeros(self.K + 2, dtype=torch.long, device=dev)  # a round's [accepted, K+1 tokens]
        self._cols = torch.arange(M, device=dev)
        self._ar = torch.arange(S, device=dev)
        self._path_slots = torch.arange(P, device=dev)
        cuda = dev.type == "cuda"
        # two pinned slots: round r+1 is launched (and its copy queued) before the host reads round r
        self._host = [torch.zeros(self.K + 2, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._done = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._run = None

    # ------------------------------------------------------------------ the device round
    def _round(self) -> Tensor:
        """One round on static buffers only: the body of the CUDA graph. Returns `info`."""
        return self._body()

    def _chain_round(self) -> Tensor:
        """A chain round (module docstring)."""
        d = self.drafting
        draft = d.draft_chain()[0]  # (K,)
        ids = torch.cat([self.pending, draft])[None]  # (1,K+1)
        slots = (d.n + self._ar)[None]  # (1,K+1) slot = RoPE position
        mask = self._cols[None, None] <= slots[:, :, None]  # (1,K+1,M) the prefix and the chain up to itself
        logits, aux = self._verify(ids, slots, slots, mask)  # (1,K+1,V), (1,K+1,3h_t)
        acc, bonus = accept(draft[None], logits.argmax(-1))  # (1,), (1,)
        tokens = torch.cat([draft, bonus]).scatter(0, acc, bonus)  # (K+1,) accepted drafts, then the bonus
        d.commit(aux, tokens, acc)
        self.pending.copy_(bonus)
        self.info[:1].copy_(acc)
        self.info[1:].copy_(tokens)
        return self.info

    def _tree_round(self) -> Tensor:
        """A tree round (module docstring)."""
        d, S, P = self.drafting, self.S, self.P
        t = d.draft_tree()  # StaticTree of S nodes after the pending token
        n = d.n
        rel = self._cols - n  # (M,) each slot relative to the first draft slot
        tree = t.mask.index_select(1, rel.clamp(0, S - 1)) & ((rel >= 0) & (rel < S))  # (S,M) ancestors' slots
        mask = ((self._cols < n)[None] | tree)[None]  # (1,S,M)
        logits, aux = self._verify(t.tokens[None], (n + t.depths)[None], (n + self._ar)[None], mask)
        greedy = logits[0].argmax(-1)  # (S,) target argmax after each node
        match = (t.tokens == greedy.index_select(0, t.parents.clamp(min=0))) | (self._ar == 0)
        accepted = ~(t.mask & ~match[None]).any(-1)  # (S,) the node and all its ancestors match
        best = (accepted * (t.depths + 1)).argmax().view(1)  # (1,) the deepest accepted node (one per depth)
        acc = t.depths.index_select(0, best)  # (1,) accepted drafts
        bonus = greedy.index_select(0, best)  # (1,)
        # the path's node indices in depth order, then filler: (P,)
        path = t.mask.index_select(0, best)[0].int().sort(descending=True, stable=True).indices[:P]
        tokens = torch.cat([t.tokens.index_select(0, path[1:]), bonus]).scatter(0, acc, bonus)  # (P,)
        self.runner.copy_slots(n + path, n + self._path_slots)
        d.commit(aux.index_select(1, path), tokens, acc)
        self.pending.copy_(bonus)
        self.info[:1].copy_(acc)
        self.info[1:].copy_(tokens)
        return self.info

    def _capture(self) -> None:
        """Set `_run`, one round: the captured graph on CUDA (captured on first use, before any prefill: the
        warm-ups write slots 0..K from n = 0 and the prefill then resets the state), `_round` elsewhere."""
        if self._run is None:
            if self.runner.device.type != "cuda":
                self._run = self._round
            else:
                calls = 0

                def body():
                    nonlocal calls
                    calls += 1
                    if calls <= WARMUP:  # the warm-ups run for real: keep their writes inside any cache
                        self.drafting.n.zero_()
                    return self._round()
                self._run = capture(body, warmup=WARMUP, cuda=True)

    def _launch(self, r: int) -> None:
        """Queue round r and the async copy of its outcome into pinned slot r % 2."""
        self._run()
        self._host[r % 2].copy_(self.info, non_blocking=True)
        if self._done is not None:
            self._done[r % 2].record()

    def _read(self, r: int) -> tuple[int, list[int]]:
        """(accepted count, emitted tokens) of round r: waits for that round only."""
        if self._done is not None:
            self._done[r % 2].synchronize()
        v = self._host[r % 2].tolist()
        return v[0], v[1:v[0] + 2]

    def _fits_another(self, committed: int) -> bool:
        """Whether a round launched behind the one in flight (which starts at `committed`) stays in the cache
        whatever the one in flight accepts: it writes slots below committed + (K+1) + width."""
        return committed + self.K + 1 + self.width <= self.runner.cfg.max_seq

    # ------------------------------------------------------------------ host loop
    def _prefill(self, prompt: list[int], chunk: int = 512) -> tuple[int, Tensor]:
        """Target slots 0..n-1 of row 0 -> (first new token, aux (1,n,3h_t)); spec.prefill."""
        last, aux = prefill(self.runner, [prompt], self.aux_ids, chunk)
        return int(last[0].argmax()), aux

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, *, eos_ids=(), seed: int = 0
                 ) -> tuple[list[int], SpecStats]:
        """New tokens for one prompt (ending at the first eos or after max_new_tokens) and stats (`seed` is
        unused: greedy)."""
        K, M, dev = self.K, self.runner.cfg.max_seq, self.runner.device
        n = len(prompt)
        if n == 0:
            raise EyasError("speculative decoding: empty prompt")
        if n + max_new_tokens + self.width > M:
            raise EyasError(f"prompt {n} + {max_new_tokens} new + {self.width - 1} draft tokens exceed the target "
                            f"cache ({M} slots)")
        self._capture()
        first, aux = self._prefill(prompt)
        d = self.drafting
        d.reset()
        d.extend(aux, torch.tensor([prompt[1:] + [first]], device=dev))
        self.pending.fill_(first)
        eos = set(eos_ids)
        out = [first]
        stats = SpecStats(target_forwards=1, accepted_at=[0] * K)
        stopped = first in eos or max_new_tokens <= 1
        committed, launched = n, 0  # committed: target slots after the rounds read so far
        while not stopped:
            if launched == stats.rounds:  # nothing in flight: launch from the known state
                assert committed + self.width <= M, "a round would write past the checked cache bound"
                self._launch(launched)
                launched += 1
            # round `stats.rounds` is in flight; queue the next one before waiting for it, unless the one in
            # flight surely ends the decoding or a second round might not fit the cache
            if len(out) + 1 < max_new_tokens and self._fits_another(committed):
                self._launch(launched)
                launched += 1
            a, toks = self._read(stats.rounds)
            stats.add_round(a)
            out += toks
            committed += a + 1
            stopped = len(out) >= max_new_tokens or any(t in eos for t in toks)
        return stats.finish(out, eos, max_new_tokens), stats
