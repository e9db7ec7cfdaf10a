"""Sampled verification with point-mass (deterministic) children: the first emitted token keeps the target's
law only if the residual is renormalised after each rejection (sampling.accept_fixed);
without it test_point_mass_children_keep_the_target_law fails."""

import math

import pytest
import torch

from eyas.decode.tree import Draft, verify

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


# ------------------------------------------------------------------ sampling: point-mass children

def chi2_critical(df, z=3.09):
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("children", [[0, 1, 2], [3, 1, 5]], ids=["top3", "mixed"])
def test_point_mass_children_keep_the_target_law(children):
    """A root with 3 deterministic children and a flat-ish target law: the first emitted token is
    distributed as p. Without renormalising the residual after each rejection, child j is accepted
    with p_j instead of p_j / (1 - rejected mass); at p = .30/.25 that moves ~7% of the mass."""
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    draft = Draft([0] + children, [-1, 0, 0, 0])  # deterministic children: q = [] (point masses)
    logits = p.log().expand(len(draft), -1)  # (S, V): every node sees the same law
    gen = torch.Generator().manual_seed(1234)
    n = 20_000
    counts = torch.zeros(len(p))
    for _ in range(n):
        path, bonus = verify(draft, logits, 1.0, 1.0, gen)
        counts[draft.tokens[path[1]] if len(path) > 1 else bonus] += 1
    stat = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert stat < chi2_critical(len(p) - 1), (stat, (counts / n).tolist())
