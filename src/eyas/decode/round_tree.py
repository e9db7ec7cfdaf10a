"""A greedy EAGLE-2 tree round as ONE CUDA graph (issue 14 items 1 and 2): propose, verify, accept, compact, extend.

Batch 1 (cache row 0), the tokens and per-round accepted counts of `SpecDecoder`'s greedy tree with the static
proposer (tests/test_round_tree.py). The host loop is `round.RoundChainDecoder`'s: a round is launched before the
host reads the previous one, whose outcome arrives by an async copy. One round, all on the device:
- propose: `cache.DraftCache`'s tree of S nodes (node 0 = the pending token; tokens, parents,
  depths and the ancestor mask on the device);
- verify: ONE target forward of the S nodes at slots n..n+S-1, positions n + depth, node i attending the committed
  slots 0..n-1 and its own ancestors (and itself), capturing the drafter's aux layers;
- accept: node i >= 1 matches when its token is the target's argmax at its parent, and is accepted when it and
  every ancestor match. A node's children carry distinct tokens, so the accepted nodes are one path from the
  root; its deepest node b, at depth a, gives the a accepted drafts and the bonus token argmax(b). This is
  `tree.verify`'s greedy walk;
- compact: the path's target k/v move from slots n + path[j] to n + j (the host loop's `copy_slots`);
- commit: the drafter appends entries at n..n+P-1 for the path's aux states paired with the next tokens (the
  accepted drafts, then the bonus), `last` = entry n+a, and n += a+1.
Fixed shapes throughout: the path is P = min(depth+1, S) node indices, the ancestors of b in index order (which
is depth order: a parent precedes its children) followed by filler; what the filler writes lies past the new n,
masked, and is overwritten by the next round.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.decode.cache import DraftCache
from eyas.decode.common import SpecConfig, fit_drafter
from eyas.decode.round import RoundChainDecoder
from eyas.errors import EyasError


class RoundTreeDecoder(RoundChainDecoder):
    """Greedy EAGLE-2 trees on a target `Runner` (batch 1, cache row 0), each round one CUDA graph on CUDA."""

    def __init__(self, runner, drafter, cfg: SpecConfig = SpecConfig(method="tree"), *,
                 compile_drafter: bool = False):
        """compile_drafter: torch.compile the drafter's part of the round (the tree proposer and the extend)."""
        if cfg.method != "tree" or cfg.temperature != 0:
            raise EyasError(f"the one-graph tree round runs greedy trees only (method tree, temperature 0), got "
                            f"method {cfg.method!r}, temperature {cfg.temperature}")
        if drafter is None:
            raise EyasError("decode method 'tree' needs a drafter")
        M, dev = runner.cfg.max_seq, runner.device
        drafter = fit_drafter(runner, drafter)
        d = DraftCache(drafter, runner.embed, slots=M, tree=(cfg.top_k, cfg.depth, cfg.total_tokens),
                       compile=compile_drafter)
        S = 1 + min(cfg.total_tokens, d.pool_depths.numel())  # the root and the kept draft nodes
        if S + 1 > M:
            raise EyasError(f"a tree of {S - 1} draft nodes does not fit a target cache of {M} slots")
        P = min(cfg.depth + 1, S)  # the longest accepted path, root included
        self._setup(runner, cfg, drafter, P - 1, S)
        self.drafting, self.S, self.P = d, S, P
        self.pending = d.root  # the proposer reads the pending token from here
        self._ar = torch.arange(S, device=dev)
        self._path_slots = torch.arange(P, device=dev)

    def _round(self) -> Tensor:
        """One round on static buffers only: the body of the CUDA graph. Returns `info`."""
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
