"""Draft trees and their verification (a chain is a tree where every node has one child).

Node 0 is the root: the pending token that the target has not processed yet. Nodes 1.. are draft
tokens, listed so that a parent always precedes its children. The target runs all nodes in one
forward, node i attending the committed prefix plus its own ancestors and itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from eyas.target.sampling import accept_fixed, accept_sampled, draw, probs


@dataclass
class Draft:
    """Draft tokens as a tree. parents[i] < i; parents[0] = -1 (the root)."""

    tokens: list[int]
    """Target ids; tokens[0] is the root (the pending token)."""
    parents: list[int]
    """Parent index of each node."""
    q: list[Tensor | None] = field(default_factory=list)
    """Per node: the (V,) target-vocab distribution the token was SAMPLED from, or None when the token
    was chosen deterministically (top-k, argmax, prompt lookup). Empty list = all deterministic."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestors(self) -> Tensor:
        """(S,S) bool: [i, j] is True when j is i or an ancestor of i."""
        S = len(self.parents)
        anc = torch.eye(S, dtype=torch.bool)
        for i in range(1, S):
            anc[i] |= anc[self.parents[i]]
        return anc

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            ch[self.parents[i]].append(i)
        return ch


def chain(root: int, tokens: list[int], q: list[Tensor | None] | None = None) -> Draft:
    n = len(tokens)
    return Draft([root] + list(tokens), list(range(-1, n)), [None] + list(q) if q else [])


def verify(draft: Draft, logits: Tensor, temperature: float, top_p: float, gen) -> tuple[list[int], int]:
    """Walk the tree with the target's logits (S,V) for every node; return (accepted path of node
    indices starting with the root 0, bonus token).

    Greedy: follow the child equal to the target's argmax. Sampling: at each node try its children
    in order with the rejection rule (standard for sampled drafts, point-mass for deterministic ones,
    updating the residual after each rejection); if all are rejected draw the bonus from the residual.
    Either way each emitted token is distributed exactly as the target's (temperature, top_p) law.
    """
    children = draft.children()
    path, node = [0], 0
    greedy = logits.argmax(-1).tolist() if temperature == 0 else None  # one device sync per round
    while True:
        if greedy is not None:
            best = greedy[node]
            nxt = next((c for c in children[node] if draft.tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            p = probs(logits[node], temperature, top_p)
            nxt = None
            for c in children[node]:
                qc = draft.q[c] if draft.q else None
                ok, p = (accept_sampled(p, qc, draft.tokens[c], gen) if qc is not None
                         else accept_fixed(p, draft.tokens[c], gen))
                if ok:
                    nxt = c
                    break
            if nxt is None:
                return path, int(draw(p[None], gen)[0])
        path.append(nxt)
        node = nxt


def select_tree(pool_tokens: list[int], pool_parents: list[int], pool_scores: list[float], pool_depths: list[int],
                total: int) -> tuple[list[int], list[int]]:
    """Keep the `total` best pool nodes by cumulative log-prob (ties: shallower first, so the kept set
    contains every ancestor of a kept node). Pool parents index the pool, -1 = root. Returns the kept
    pool indices ordered by depth and the parents re-indexed into the Draft numbering (root = 0)."""
    order = sorted(range(len(pool_tokens)), key=lambda i: (-pool_scores[i], pool_depths[i], i))[:total]
    order.sort(key=lambda i: (pool_depths[i], i))
    where = {-1: 0}
    parents = []
    for j, i in enumerate(order):
        where[i] = j + 1
        parents.append(where[pool_parents[i]])
    return order, parents
