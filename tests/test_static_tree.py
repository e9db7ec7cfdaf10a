"""The static (graph-friendly) EAGLE-2 tree proposer proposes exactly the eager proposer's trees.

fp32 on the CPU, the tiny peaky target and briefly trained drafter of test_decode.py. Both proposers run inside
a `SpecDecoder` on the same prompts (the static one wired in as docs/decoding.md describes), and every round's
tree is recorded:
(a) the trees are equal round by round: tokens, parents, verify mask and positions (depths), for several
    top_k / depth / total settings including the default 10/6/60 tree and a draft vocabulary smaller than top_k;
(b) sampled (temperature > 0) decoding with one seed draws the eager decoder's tokens (greedy decoding in every
    tree mode: test_graph_round_tree.py);
(c) under the gpu marker: the CUDA-graphed proposer on CUDA equals the CPU one, and its round never syncs.
Ties: draft logits rounded to multiples of 0.5 make most decisions ties; the static trees must then equal the
eager ones with `Tensor.topk` replaced by a stable sort (the canonical order of decode/tree_static.py). Injected
bugs (missing ancestor, wrong parent row, wrong parent rank, reversed ties) each fail one of these checks.
"""

import copy

import pytest
import torch

from support.models import make_tiny_llama
from eyas.decode import tree_static as ts
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.decode.tree import Draft, select_tree
from eyas.decode.cache import DraftCache
from eyas.decode.tree_static import ancestor_mask, select, stable_topk, tree_plan
from eyas.target.runner import Runner
from support.drafters import eagle3_for_model
from test_decode import peaky, train_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

NEW = 24
# (drafter, top_k, depth, total_tokens): the test_decode tree, the default tree, a pool smaller than total
# (3 + 2*9 = 21 < 30), a deep narrow tree, depth 1, a top-1 tree (a chain), a draft vocab of 8 < top_k
SETTINGS = [("trained", 4, 5, 16), ("trained", 10, 6, 60), ("trained", 3, 3, 30), ("trained", 2, 7, 12),
            ("trained", 5, 1, 4), ("trained", 1, 4, 4), ("vocab8", 10, 4, 40)]
IDS = [f"{d}-{k}x{n}-{t}" for d, k, n, t in SETTINGS]


@pytest.fixture(scope="module")
def setup():
    model = peaky(make_tiny_llama(seed=11), 4.0, 0.3)
    runner = Runner.from_hf(model, max_batch=8, max_seq=352)
    drafters = {"trained": train_drafter(model, runner), "vocab8": eagle3_for_model(model, seed=3, draft_vocab=8)}
    with torch.no_grad():  # an untrained drafter with uneven laws, so that its trees are not flat
        drafters["vocab8"].lm_head.weight.mul_(30.0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 2, 5, 11, 23, 37, 120, 240)]
    free = runner.generate(prompts, NEW)
    eos = int(torch.bincount(torch.tensor(sum(free, [])), minlength=256).argmax())  # some rows end at eos
    ref = runner.generate(prompts, NEW, eos_ids=[eos])
    return model, runner, drafters, prompts, ref, eos


def static_decoder(runner, drafter, cfg: SpecConfig) -> SpecDecoder:
    """The SpecDecoder's own fast tree path (the default on CUDA), forced on the CPU."""
    dec = SpecDecoder(runner, drafter, cfg, fast=True)
    assert isinstance(dec.drafting, DraftCache) and dec.drafting.tree == (cfg.top_k, cfg.depth, cfg.total_tokens)
    return dec


def decode(dec: SpecDecoder, prompts, eos):
    """-> (tokens per prompt, accepted counts per prompt, every round's tree (tokens, parents, depths, mask))."""
    trees, propose = [], dec.drafting.propose_tree

    def rec(*a):
        d = propose(*a)
        trees.append((list(d.tokens), list(d.parents), list(d.depths), d.ancestors().cpu().clone()))
        return d

    dec.drafting.propose_tree = rec
    outs, acc = [], []
    for p in prompts:
        o, s = dec.generate(p, NEW, eos_ids=[eos])
        outs.append(o)
        acc.append(s.accepted)
    return outs, acc, trees


def assert_same_trees(static, eager):
    assert len(static) == len(eager), (len(static), len(eager))
    for r, ((t, p, d, m), (te, pe, de, me)) in enumerate(zip(static, eager)):
        assert t == te, f"round {r}: tokens {t} != {te}"
        assert p == pe, f"round {r}: parents {p} != {pe}"
        assert d == de, f"round {r}: positions (depths) {d} != {de}"
        assert torch.equal(m, me), f"round {r}: verify mask differs"
        ref = Draft(t, p)  # the mask and depths the eager decoder derives from the parents
        assert torch.equal(m, ref.ancestors()) and d == ref.depths, f"round {r}: mask/depths != parents'"


def pool_size(top_k, depth, vocab):
    return min(top_k, vocab) * (1 + sum(tree_plan(top_k, depth, vocab)))


_runs = {}


def runs(setup, setting):
    """Eager and static decodes of every prompt for one setting (memoised: tests (a) and (b) share them)."""
    if setting not in _runs:
        model, runner, drafters, prompts, ref, eos = setup
        name, top_k, depth, total = setting
        cfg = SpecConfig(method="tree", top_k=top_k, depth=depth, total_tokens=total)
        eager = decode(SpecDecoder(runner, drafters[name], cfg, fast=False), prompts, eos)
        static = decode(static_decoder(runner, drafters[name], cfg), prompts, eos)
        _runs[setting] = eager, static
    return _runs[setting]


# ----------------------------------------------------------------------------- (a) and (b)
@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_static_trees_equal_eager_trees(setup, setting):
    (_, _, eager), (_, _, static) = runs(setup, setting)
    assert_same_trees(static, eager)
    name, top_k, depth, total = setting
    vocab = setup[2][name].config.draft_vocab_size
    assert {len(t) for t, *_ in static} == {1 + min(total, pool_size(top_k, depth, vocab))}
    if depth >= 3 and top_k > 1:  # not vacuous: deep nodes from expanded non-first frontier rows, branching
        assert max(max(d) for _, _, d, _ in static) >= 3
        assert any(max(p.count(i) for i in range(len(p))) >= 2 for _, p, _, _ in static)


def test_sampled_tree_decoding_equals_eager(setup):
    """The tree does not depend on the temperature: with the same seed, sampled tree decoding with the static
    proposer draws the eager decoder's tokens, round by round (the point-mass rule of tree.verify, unchanged)."""
    model, runner, drafters, prompts, ref, eos = setup
    cfg = SpecConfig(method="tree", top_k=4, depth=5, total_tokens=16, temperature=0.8)
    eager = SpecDecoder(runner, drafters["trained"], cfg, fast=False)
    static = static_decoder(runner, drafters["trained"], cfg)
    for p in prompts[:4]:
        for seed in (0, 1):
            (a, sa), (b, sb) = eager.generate(p, NEW, seed=seed), static.generate(p, NEW, seed=seed)
            assert a == b and sa.accepted == sb.accepted


# ----------------------------------------------------------------------------- ties
def sorted_topk(self, k, dim=-1, largest=True, sorted=True):
    """Tensor.topk by a stable sort: ties in ascending index order (the canonical order)."""
    v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))


def tie_trees(setup, monkeypatch, cfg, prompts):
    """Eager (stable-sort topk) and static trees with the trained drafter's logits rounded to 0.5."""
    model, runner, drafters, _, ref, eos = setup
    d = drafters["trained"]
    logits = d.logits
    monkeypatch.setattr(d, "logits", lambda h: (logits(h) * 2).round() / 2)
    static = decode(static_decoder(runner, d, cfg), prompts, eos)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", sorted_topk)
        eager = decode(SpecDecoder(runner, d, cfg, fast=False), prompts, eos)
    return static, eager


@pytest.mark.parametrize("cfg", [SpecConfig(method="tree", top_k=4, depth=5, total_tokens=16),
                                 SpecConfig(method="tree")], ids=["4x5-16", "default"])
def test_ties_follow_the_canonical_order(setup, monkeypatch, cfg):
    prompts, ref = setup[3][::2], setup[4][::2]
    (outs, acc, static), (_, acc_e, eager) = tie_trees(setup, monkeypatch, cfg, prompts)
    assert_same_trees(static, eager)
    assert outs == ref and acc == acc_e


def test_selection_equals_select_tree_on_pools_with_ties():
    """`select` (topk + cumsum rank) == tree.select_tree (Python sort) on random level-major pools whose
    integer scores tie everywhere, children tying their parents included."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        k, depth = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        scores = (-torch.randint(0, 3, (k,), generator=g)).float()
        parents, depths, front = [-1] * k, [1] * k, list(range(k))
        sc = scores.tolist()
        for level in range(2, depth + 1):
            for p in front:
                for _ in range(k):
                    parents.append(p)
                    depths.append(level)
                    sc.append(sc[p] - int(torch.randint(0, 3, (1,), generator=g)))
            front = sorted(range(len(sc) - len(front) * k, len(sc)), key=lambda i: -sc[i])[:k]
        total = int(torch.randint(1, len(sc) + 3, (1,), generator=g))
        keep, tparents = select(torch.tensor(sc), torch.tensor(parents), total)
        keep_ref, tparents_ref = select_tree(list(range(len(sc))), parents, sc, depths, total)
        assert keep.tolist() == keep_ref and tparents.tolist() == tparents_ref, trial
        tp = [-1] + tparents_ref
        assert torch.equal(ancestor_mask(torch.tensor(tp), depth), Draft([0] * len(tp), tp).ancestors()), trial


def test_stable_topk_order():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -0.0, 0.0, -1.5, 3.0, 0.0]])
    v, i = stable_topk(x, 9)  # -0.0 and +0.0 tie
    assert i.tolist() == [[1, 2, 4, 8, 3, 0, 5, 6, 9]] and v.tolist() == [[3, 3, 3, 3, 2, 1, 0, 0, 0]]
    v, i = stable_topk(torch.zeros(40000), 5)
    assert i.tolist() == [0, 1, 2, 3, 4]
    y = torch.randn(3, 1000)
    assert torch.equal(stable_topk(y, 10)[0], y.topk(10).values)  # no ties: plain topk


@pytest.mark.parametrize("n,device", [(ts.SORT_MAX + 1, "cpu"), (40000, "cpu"),
                                      pytest.param(40000, "cuda", marks=pytest.mark.gpu),
                                      pytest.param(40000, "compiled", marks=pytest.mark.gpu)])
def test_stable_topk_long_rows_equal_a_stable_sort(n, device):
    """Rows longer than SORT_MAX (the draft vocabulary) take topk + a sort of the kept: the CPU stable sort's
    answer, under heavy ties (small integers, -0.0 and +0.0, -inf) and without; on CUDA eager and compiled too."""
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fn = torch.compile(stable_topk, dynamic=False) if device == "compiled" else stable_topk
    g = torch.Generator().manual_seed(n)
    rows = [torch.randint(-3, 2, (4, n), generator=g).float(), torch.randn(2, n, generator=g),
            torch.full((1, n), float("-inf")), torch.zeros(1, n)]
    rows[0][0, ::7] = -0.0
    rows[0][1, 5:] = float("-inf")
    for x in rows:
        for k in (1, 3, 10, 64):
            want_v, want_i = x.sort(dim=-1, descending=True, stable=True)
            v, i = fn(x.to("cpu" if device == "cpu" else "cuda"), k)
            v, i = v.cpu(), i.cpu()
            assert torch.equal(i, want_i[..., :k]) and torch.equal(v, want_v[..., :k]), (x[0, :4], k)


# ----------------------------------------------------------------------------- no host sync in a round
def trap_host_reads(monkeypatch) -> list[str]:
    """From now on every Tensor method that reads a value back to the host (a sync on CUDA) is recorded, by name,
    in the returned list."""
    calls = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"):
        orig = getattr(torch.Tensor, name)

        def trap(self, *a, _name=name, _orig=orig, **kw):
            calls.append(_name)
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, trap)
    return calls


def test_a_round_never_reads_the_device(setup, monkeypatch):
    """propose() calls no item/tolist/bool/int/float on a tensor (each one is a host sync on CUDA); the
    Draft conversion is one tolist."""
    model, runner, drafters, prompts, *_ = setup
    cfg = SpecConfig(method="tree")
    dec = static_decoder(runner, drafters["trained"], cfg)
    dec.generate(prompts[3], 4)  # a committed state after a few rounds
    calls = trap_host_reads(monkeypatch)
    tree = dec.drafting.draft_tree(prompts[3][-1])
    assert calls == [], calls
    dec.drafting.propose_tree(prompts[3][-1], cfg.top_k, cfg.depth, cfg.total_tokens)
    assert calls == ["tolist"], calls
    assert tree.tokens.shape == (61,) and tree.mask.shape == (61, 61)


def test_bad_sizes_refused(setup):
    model, runner, drafters, *_ = setup
    with pytest.raises(ValueError):
        DraftCache(drafters["trained"], runner.embed, slots=352, tree=(0, 6, 60))
    dec = static_decoder(runner, drafters["trained"], SpecConfig(method="tree"))
    with pytest.raises(ValueError, match="10/6/60"):
        dec.drafting.propose_tree(5, 4, 6, 60)


# ----------------------------------------------------------------------------- injected bugs
def _mask_without_parent(orig):
    def bug(parents, depth):
        anc = orig(parents, depth).clone()
        deep = (parents > 0).nonzero().flatten()
        anc[deep, parents[deep]] = False  # nodes below depth 1 do not see their parent
        return anc
    return bug


def _parent_row_mod(orig):
    def bug(cum, n):
        best, _ = orig(cum, n)
        return best, best % cum.shape[1]  # the parent row taken modulo instead of divided
    return bug


def _parent_rank_off(orig):
    def bug(scores, parents, total):
        keep, tparents = orig(scores, parents, total)
        return keep, torch.where(tparents > 1, tparents - 1, tparents)  # re-indexed one node too early
    return bug


def _ties_high_first(orig):
    def bug(x, k):
        flipped = x.flip(-1)
        v, i = orig(flipped, k)
        return v, x.shape[-1] - 1 - i
    return bug


BUGS = [("ancestor_mask", _mask_without_parent), ("frontier", _parent_row_mod), ("select", _parent_rank_off),
        ("stable_topk", _ties_high_first)]


@pytest.mark.parametrize("bug", BUGS, ids=["mask-missing-parent", "parent-row-mod", "parent-rank-off",
                                            "ties-high-index-first"])
def test_injected_bugs_are_caught(setup, monkeypatch, bug):
    name, make = bug
    model, runner, drafters, prompts, ref, eos = setup
    cfg = SpecConfig(method="tree", top_k=4, depth=5, total_tokens=16)
    eager = runs(setup, ("trained", 4, 5, 16))[0]
    monkeypatch.setattr(ts, name, make(getattr(ts, name)))
    if name == "stable_topk":  # without ties the order of equal values cannot matter: the tie test catches it
        (_, _, static), (_, _, tied) = tie_trees(setup, monkeypatch, cfg, prompts[::2])
        with pytest.raises(AssertionError):
            assert_same_trees(static, tied)
        return
    outs, acc, static = decode(static_decoder(runner, drafters["trained"], cfg), prompts, eos)
    with pytest.raises(AssertionError):
        assert_same_trees(static, eager[2])
    if name == "ancestor_mask":  # the target verifies with the wrong mask: no longer lossless
        assert outs != ref


# ----------------------------------------------------------------------------- (c) CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting,compile", [(("trained", 4, 5, 16), False), (("trained", 10, 6, 60), False),
                                             (("trained", 10, 6, 60), True)], ids=["4x5-16", "default", "compiled"])
def test_cuda_graphed_static_tree_equals_cpu(setup, setting, compile):
    """The proposer on CUDA (one CUDA graph per round; compiled or not) proposes the CPU proposer's trees and
    decodes the same tokens with the same acceptance; its round, run eagerly under the sync debugger, never syncs."""
    model, runner, drafters, prompts, ref, eos = setup
    name, top_k, depth, total = setting
    cfg = SpecConfig(method="tree", top_k=top_k, depth=depth, total_tokens=total)
    _, (outs_cpu, acc_cpu, trees_cpu) = runs(setup, setting)
    gpu = Runner.from_hf(model, max_batch=1, max_seq=runner.cfg.max_seq, device="cuda")
    dec = SpecDecoder(gpu, copy.deepcopy(drafters[name]), cfg, compile_drafter=compile)  # fast: the CUDA default
    assert isinstance(dec.drafting, DraftCache) and dec.drafting.tree == (cfg.top_k, cfg.depth, cfg.total_tokens)
    outs, acc, trees = decode(dec, prompts, eos)
    assert ("tree",) in dec.drafting.graph_keys and dec.drafting.keys.is_cuda
    assert outs == ref == outs_cpu
    assert acc == acc_cpu
    assert_same_trees(trees, trees_cpu)
    torch.cuda.synchronize()
    # under no_grad, as generate() runs it: a compiled proposer called with grad on recompiles, and inductor's
    # compile syncs (constant folding), which the debugger would blame on the round
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            dec.drafting._tree_fn()  # outside the graph (compiled or eager): a sync inside would raise here
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_compiled_static_tree_equals_eager(setup):
    """compile_drafter for trees (torch.compile of the proposer and the extends; inductor on the CPU): the same
    trees round by round, the same tokens and acceptance as the eager proposer."""
    from torch._dynamo.utils import counters

    model, runner, drafters, prompts, ref, eos = setup
    cfg = SpecConfig(method="tree", top_k=4, depth=5, total_tokens=16)
    dec = SpecDecoder(runner, drafters["trained"], cfg, fast=True, compile_drafter=True)
    assert hasattr(dec.drafting._tree_fn, "_torchdynamo_orig_callable")
    torch._dynamo.reset()  # every DraftCache compiles the same bodies: count this test's compiles
    counters.clear()
    outs, acc, trees = decode(dec, prompts[:4], eos)
    assert counters["stats"]["unique_graphs"] >= 1
    eager = decode(SpecDecoder(runner, drafters["trained"], cfg, fast=False), prompts[:4], eos)
    assert outs == ref[:4] and acc == eager[1]
    assert_same_trees(trees, eager[2])
