"""The pieces of the graph-friendly EAGLE-2 dynamic tree (`cache.DraftCache.draft_tree`): fixed-size device tensors,
no host sync, exactly the tree of `eagle.EagleDrafting.propose_tree` in the same node order (tests/test_static_tree.py),
so the verify forward, `tree.verify` and the slot compaction are shared.

The tree, per round (k = min(top_k, draft vocab)):
- level 1: the k best draft tokens after the last committed entry, score = draft log-prob;
- level l = 2..depth: the frontier (all level-1 nodes, then the top_k best nodes of the previous level by
  cumulative log-prob) runs one drafter step at RoPE position n + l - 2, each frontier node attending the
  committed entries, its ancestors' draft entries and itself; each gets its k best children,
  score = parent score + child log-prob;
- the pool is level-major, and within a level (frontier row, child rank): its index i is fixed by the shapes;
- keep the `total` best pool nodes by (-score, depth, pool index), listed by (depth, pool index).
Every level has a fixed size (`tree_plan`), so the round is straight-line tensor code: top-k and gathers, draft
keys in a scratch region of the static cache, each frontier row's ancestors as a bool row over that region, the
final selection by top-k over the pool, parents re-indexed through a cumsum rank, and the verify mask and
positions built on the device.

Canonical order under ties. `torch.topk` does not define the order of equal values (CPU and CUDA differ), and bf16
logits make ties common, so this tree breaks every tie by the LOWER index: among children of a node, the lower
draft-vocab id; in the frontier, the lower (row, rank) position; in the final selection, the lower pool index.
Pool indices grow with depth, so the last is the eager `select_tree` key (-score, depth, index) exactly, and a
parent (score >= its child's, lower index) is always kept before its child. `stable_topk` implements it without
an int64 scan or packed keys, both of which inductor failed to compile for CUDA (docs/LOG.md, "decode/ redesign").
Without ties both proposers give the same tree; the eager one follows the canonical order when `Tensor.topk` is a
stable sort (how tests/test_static_tree.py checks ties). NaN draft log-probs are not supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from eyas.decode.tree import Draft


# ---------------------------------------------------------------------------------------------- pieces
SORT_MAX = 4096  # rows up to this long: one stable sort (a single in-block sort kernel on CUDA)


def stable_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last dim in the canonical order (value descending, ties by ascending index).

    Long rows (the draft vocabulary) take `topk` for the k-th largest value t, which is exact whatever order topk
    lists ties in: the k kept are every entry above t and the lowest-index entries equal to t. A stable sort of
    those k orders them (a stable sort of the whole vocabulary costs a multi-pass radix sort:
    BENCHMARKS.md#kernels-per-decode-step-and-round-benchmarkskernelspy---compile-first-lease)."""
    n = x.shape[-1]
    if n <= SORT_MAX or k >= n or n >= 1 << 24:  # the float priority below is exact below 2**24 entries
        values, idx = x.sort(dim=-1, descending=True, stable=True)
        return values[..., :k], idx[..., :k]
    t = x.topk(k, dim=-1).values[..., -1:]                                 # (..., 1) the k-th largest value
    cols = torch.arange(n, device=x.device, dtype=torch.float32)
    # priority: every entry above t (fewer than k of them), then the ties by ascending index, the rest last
    prio = torch.where(x > t, 2.0 * n, torch.where(x == t, n - cols, -1.0))
    idx = prio.topk(k, dim=-1).indices.sort(dim=-1).values                 # the kept k, index ascending
    values, order = x.gather(-1, idx).sort(dim=-1, descending=True, stable=True)  # ties stay index-ascending
    return values, idx.gather(-1, order)


def frontier(cum: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """cum (F, kk) scores of a level -> (flat indices (n,) of its n best nodes, their parent rows (n,))."""
    _, best = stable_topk(cum.flatten(), n)
    return best, best // cum.shape[1]


def select(scores: Tensor, parents: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Keep the `total` best pool nodes; pool parents index the pool (-1 = root).

    -> (kept pool indices ascending (n,), their parents in the Draft numbering (n,), root = 0, kept j = j+1).
    The kept set is ancestor-closed (module docstring), so every parent has a rank."""
    P = scores.numel()
    n = min(total, P)
    _, top = stable_topk(scores, n)                                         # (n,)
    rank = torch.zeros(P + 1, dtype=torch.long, device=scores.device)      # [0] = root; [i+1] = pool node i
    rank[1:].scatter_(0, top, torch.ones_like(top))
    rank = rank.cumsum(0)                                                   # kept node i: its Draft index
    keep = torch.empty_like(top).scatter_(0, rank[top + 1] - 1, top)       # (n,) ascending pool order
    return keep, rank[parents[keep] + 1]


def ancestor_mask(parents: Tensor, depth: int) -> Tensor:
    """parents (S,) (parents[0] = -1, tree depth <= depth) -> (S,S) bool, [i, j]: j is i or an ancestor of i."""
    S = parents.numel()
    eye = torch.eye(S, dtype=torch.bool, device=parents.device)
    up = parents.clamp(min=0)  # the root is its own parent here
    anc = eye
    for _ in range(depth):  # after t steps row i holds its ancestors up to t levels up
        anc = eye | anc[up]
    return anc


def tree_plan(top_k: int, depth: int, draft_vocab: int) -> list[int]:
    """Frontier sizes of levels 2..depth (the rows of each drafter step); [] for depth 1."""
    k = min(top_k, draft_vocab)
    sizes, f = [], k
    for _ in range(2, depth + 1):
        sizes.append(f)
        f = min(top_k, f * k)
    return sizes


# ---------------------------------------------------------------------------------------------- outputs
@dataclass
class StaticTree:
    """One round's tree on the device, nodes in the eager Draft order (node 0 = root)."""

    tokens: Tensor
    """(S,) int64 target ids; tokens[0] is the root (pending token)."""
    parents: Tensor
    """(S,) int64 parent node of each node, parents[0] = -1."""
    depths: Tensor
    """(S,) int64 depth in draft tokens (root 0): the verify positions are prefix + depths."""
    mask: Tensor
    """(S,S) bool: node i attends node j iff j is i or an ancestor of i (plus the whole prefix)."""

    def to_draft(self) -> "TreeDraft":
        """The `tree.Draft` that `tree.verify` walks: ONE device-to-host copy."""
        S = self.tokens.numel()
        host = torch.cat([self.tokens, self.parents, self.depths]).tolist()
        return TreeDraft(host[:S], host[S:2 * S], levels=host[2 * S:], tree=self)


@dataclass
class TreeDraft(Draft):
    """A Draft whose verify mask and depths are the ones built on the device."""

    levels: list[int] = field(default_factory=list)
    tree: StaticTree | None = None

    @property
    def depths(self) -> list[int]:
        return self.levels

    def ancestors(self) -> Tensor:
        return self.tree.mask
