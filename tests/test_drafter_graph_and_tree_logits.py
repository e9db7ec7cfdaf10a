"""The drafter's logits along its decoding paths: a CUDA-graphed chain equals the eager chain (no step attends a
stale slot), and every tree node equals the chain forced along its path (nodes attend their draft ancestors; each
level expands from its parent's hidden state).

Each test fails under a mutation of the code:

| mutation                                                               | test                                        |
|------------------------------------------------------------------------|---------------------------------------------|
| graphed drafter: a draft step attends one stale slot                   | test_graphed_chain_logits_equal_eager_*      |
| tree: nodes do not attend their draft ancestors                        | test_tree_node_logits_equal_forced_chains    |
| tree: next level expanded from the wrong parent's hidden state         | test_tree_node_logits_equal_forced_chains    |
"""

import copy

import pytest
import torch

from support.models import make_tiny_llama
from eyas.decode.eagle import EagleDrafting
from eyas.decode.cache import DraftCache
from eyas.decode.tree import Draft, chain, select_tree
from eyas.model.drafter import DrafterConfig, Eagle3Drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


# ------------------------------------------------------------------ drafter helpers

V, DV = 256, 100


def drafter_and_embeddings(seed=0, draft_vocab=V, std=0.2):
    """A tiny random drafter with weights large enough that its logits are far from flat."""
    model = make_tiny_llama(seed=3)
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=draft_vocab, aux_layer_ids=(1, 2, 3))
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg).eval()
    d.init_weights(std)
    if draft_vocab < V:
        ids = torch.randperm(V)[:draft_vocab].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        d.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return d, model.get_input_embeddings()


class LogitsRecorder:
    """Wraps drafter.logits: every call's output is kept (under a CUDA graph: the graph's output buffers)."""

    def __init__(self, drafter):
        self.fn, self.calls = drafter.logits, []
        drafter.logits = self

    def __call__(self, hidden):
        out = self.fn(hidden)
        self.calls.append(out)
        return out


# ------------------------------------------------------------------ graphed vs eager chain drafter

def graphed_vs_eager(device, rounds=12, K=4):
    """Drive both chain drafters through the same rounds (prefill, then per round: propose, accept j of K
    drafts with j random in 0..K, extend with j+1 fresh entries) and compare their draft logits."""
    d, embed = drafter_and_embeddings()
    d, embed = d.to(device), embed.to(device)
    dg = copy.deepcopy(d)
    rec_e, rec_g = LogitsRecorder(d), LogitsRecorder(dg)
    eager = EagleDrafting(d, embed)
    graphed = DraftCache(dg, embed, slots=128, k=K, graphs=True)
    g = torch.Generator().manual_seed(0)
    hs = embed.weight.shape[1]
    aux, toks = torch.randn(1, 12, 3 * hs, generator=g), torch.randint(0, V, (1, 12), generator=g)
    for x in (eager, graphed):
        x.reset()
        x.extend(aux.to(device), toks.to(device))
    graph_out, accepted = None, []
    for _ in range(rounds):
        de = eager.propose_chain(5, K, 0.0, 1.0, None, V)
        le = torch.cat([c[0, -1:] for c in rec_e.calls[-K:]]).float()  # (K, Vd)
        before = len(rec_g.calls)
        dgr = graphed.propose_chain(5, K, 0.0, 1.0, None, V)
        if len(rec_g.calls) > before:  # first call (eager on the CPU every time; captured once on CUDA)
            graph_out = rec_g.calls[-K:]
        lg = torch.cat([c[0, -1:] for c in graph_out]).float()  # (K, Vd)
        torch.testing.assert_close(lg, le, rtol=1e-4, atol=1e-4)
        assert dgr.tokens == de.tokens
        j = int(torch.randint(0, K + 1, (1,), generator=g))
        accepted.append(j)
        new = de.tokens[1:1 + j] + [int(torch.randint(0, V, (1,), generator=g))]
        a = torch.randn(1, j + 1, 3 * hs, generator=g).to(device)
        for x in (eager, graphed):
            x.rollback()
            x.extend(a, torch.tensor([new], device=device))
    assert 0 in accepted and K in accepted  # rounds with rejections (stale draft slots) and full accepts


def test_graphed_chain_logits_equal_eager_cpu():
    """cache.DraftCache's static-cache logic without CUDA graphs (on the CPU _capture is a plain call)."""
    graphed_vs_eager("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_chain_logits_equal_eager_cuda():
    graphed_vs_eager("cuda")


# ------------------------------------------------------------------ tree drafter vs forced chains

def forced_logits(drafting, drafter, embed, path):
    """Naive reference: (Vd,) draft logits after feeding the target ids `path` one at a time from the
    committed state, each step attending the whole cache (committed entries + its own ancestors)."""
    hidden, k, v, n = drafting.last, drafting.keys, drafting.values, drafting.n
    for step, tok in enumerate(path):
        mask = torch.ones(1, 1, k.shape[2] + 1, dtype=torch.bool)
        hidden, (k, v) = drafter.layer(hidden, embed(torch.tensor([[tok]])), torch.tensor([[n + step]]), mask, (k, v))
    return drafter.logits.fn(hidden)[0, -1].float()


def naive_tree(drafting, drafter, embed, root, top_k, depth, total):
    """EAGLE-2 dynamic tree built node by node from forced chains -> (Draft, per-level (F, Vd) logits)."""
    lg = forced_logits(drafting, drafter, embed, [])
    levels = [lg[None]]
    s, i = torch.log_softmax(lg, -1).topk(top_k)
    toks = drafter.draft_to_target(i).tolist()
    scores, parents, depths = s.tolist(), [-1] * len(toks), [1] * len(toks)
    paths = {j: [t] for j, t in enumerate(toks)}
    frontier = list(range(len(toks)))
    for level in range(2, depth + 1):
        lg = torch.stack([forced_logits(drafting, drafter, embed, paths[j]) for j in frontier])  # (F, Vd)
        levels.append(lg)
        cs, ci = torch.log_softmax(lg, -1).topk(top_k, dim=-1)  # (F, k)
        cum = cs + torch.tensor([scores[j] for j in frontier])[:, None]  # (F, k)
        base = len(toks)
        for r, t in enumerate(drafter.draft_to_target(ci).flatten().tolist()):
            par = frontier[r // top_k]
            paths[base + r] = paths[par] + [t]
            toks.append(t)
            parents.append(par)
            depths.append(level)
        scores += cum.flatten().tolist()
        frontier = [base + b for b in cum.flatten().topk(min(top_k, cum.numel())).indices.tolist()]
    keep, tparents = select_tree(toks, parents, scores, depths, total)
    return Draft([root] + [toks[j] for j in keep], [-1] + tparents), levels


@pytest.fixture(scope="module")
def tree_setup():
    d, embed = drafter_and_embeddings(seed=1, draft_vocab=DV)
    rec = LogitsRecorder(d)
    drafting = EagleDrafting(d, embed)
    g = torch.Generator().manual_seed(2)
    hs = embed.weight.shape[1]
    drafting.extend(torch.randn(1, 12, 3 * hs, generator=g), torch.randint(0, V, (1, 12), generator=g))
    return d, embed, rec, drafting


def test_top1_tree_logits_equal_chain(tree_setup):
    d, embed, rec, drafting = tree_setup
    rec.calls.clear()
    tree = drafting.propose_tree(7, 1, 5, 20)
    tree_logits = [c[0, -1].float() for c in rec.calls]
    rec.calls.clear()
    ch = drafting.propose_chain(7, 5, 0.0, 1.0, None, V)
    chain_logits = [c[0, -1].float() for c in rec.calls]
    assert len(tree_logits) == len(chain_logits) == 5
    for level, (a, b) in enumerate(zip(tree_logits, chain_logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"level {level + 1}")
    assert tree.tokens == ch.tokens and tree.parents == chain(7, ch.tokens[1:]).parents


@pytest.mark.parametrize("top_k", [2, 3])
def test_tree_node_logits_equal_forced_chains(tree_setup, top_k):
    """Each expanded node's draft logits equal a chain forced along its ancestors; the tree equals the
    one built from those chains. Catches a node that misses its ancestors in the mask, and a level
    expanded from another parent's hidden state."""
    d, embed, rec, drafting = tree_setup
    rec.calls.clear()
    tree = drafting.propose_tree(7, top_k, 5, 20)
    got = [c[0].float() for c in rec.calls]  # level 1: (1, Vd); level l > 1: (F, Vd) in frontier order
    with torch.no_grad():
        ref, levels = naive_tree(drafting, d, embed, 7, top_k, 5, 20)
    assert len(got) == len(levels) == 5
    for level, (a, b) in enumerate(zip(got, levels)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"level {level + 1}")
    assert tree.tokens == ref.tokens and tree.parents == ref.parents
    assert max(tree.depths) >= 3  # the kept tree reaches levels built from expanded nodes
