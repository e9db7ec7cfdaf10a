"""DFlash block drafting at decode time: lossless against plain greedy, the static context cache against a
from-scratch recompute, the sampled law against the target's, and the refusals."""

from dataclasses import replace

import pytest
import torch

from support.models import make_tiny_llama
from eyas.decode import tree as tree_mod
from eyas.decode.dflash import DFlashDrafting
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.errors import EyasError
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.target.runner import Runner
from eyas.train.dflash import BlockLossConfig, block_hidden, dflash_forward
from test_decode import chi2, chi2_critical, exact_laws, peaky

AUX = (1, 2, 3)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def make_dflash(model, *, block=6, seed=0, std=0.02, mask_token_id=None):
    """A random DFlash drafter for `model`; a larger std makes its attention sharp, so positions matter."""
    torch.manual_seed(seed)
    V = model.config.vocab_size
    cfg = DFlashConfig.from_target(model.config, aux_layer_ids=AUX, mask_token_id=V - 1 if mask_token_id is None
                                   else mask_token_id, num_layers=2, block_size=block)
    d = DFlashDrafter(cfg)
    d.init_weights(std)
    return d.eval()


@pytest.fixture(scope="module")
def setup():
    model = peaky(make_tiny_llama(seed=11), 4.0, 0.3)
    runner = Runner.from_hf(model, max_batch=1, max_seq=160)
    g = torch.Generator().manual_seed(1)
    lengths = [1, 2, 3, 7, 15, 30, 64]
    prompts = [torch.randint(3, 255, (n,), generator=g).tolist() for n in lengths]
    ref = runner.generate(prompts, 24)
    return model, runner, prompts, ref


def decode_all(dec, prompts, n=24):
    outs, stats = [], []
    for p in prompts:
        o, s = dec.generate(p, n)
        outs.append(o)
        stats.append(s)
    return outs, stats


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("block,k", [(4, 3), (8, 7), (8, 2)])
def test_greedy_dflash_equals_plain_greedy(setup, block, k, fast):
    """Lossless at every block size and chain length, with the sliced (eager) and the masked fixed-shape (the CUDA
    graph's) block forward; rounds propose k drafts and accept at most k."""
    model, runner, prompts, ref = setup
    dec = SpecDecoder(runner, make_dflash(model, block=block, seed=block + k), SpecConfig(method="chain", k=k),
                      fast=fast)
    assert isinstance(dec.drafting, DFlashDrafting) and dec.mode == ("static" if fast else "eager")
    outs, stats = decode_all(dec, prompts)
    assert outs == ref
    for s, o, p in zip(stats, outs, prompts):
        assert s.target_forwards == 1 + s.rounds and s.tokens == len(o)
        assert max(s.accepted, default=0) <= k and len(s.accepted_at) == k


def naive_block(model, drafter, runner, seq: list[int], root: int) -> torch.Tensor:
    """The block logits (B-1,V) from scratch: the HF target's aux states of every committed token seq (positions
    0..n-1) as the context, [root, MASK..] at n..n+B-1, mask None, the target's head."""
    n, cfg = len(seq), drafter.config
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[a] for a in AUX], -1)  # (1,n,3h)
        ctx = drafter.context_kv(aux, torch.arange(n)[None])
        ids = torch.tensor([[root] + [cfg.mask_token_id] * (cfg.block_size - 1)])
        h = drafter(drafter.embed_block(ids, runner.embed.weight), torch.arange(n, n + cfg.block_size)[None], ctx)
        return runner.lm_head(h[0, 1:]).float()


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "static"])
def test_static_context_cache_equals_recompute_from_scratch(setup, fast):
    """Every round's block, from the appended context cache, equals a recompute over all committed tokens' aux
    states from the HF model: the context holds positions 0..n-1, the root is token n, nothing else is cached.
    The drafts handed on are then replaced by the target's own continuation with one wrong token at slot j (j
    cycling 0..k), so rounds accept every count 0..k and append 1..k+1 entries."""
    model, runner, prompts, ref = setup
    drafter = make_dflash(model, block=6, seed=4, std=0.3)
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=5), fast=fast)
    dr = dec.drafting
    block = dr.block
    checked, accepted = [], []
    for p, r in zip(prompts[1:], ref[1:]):
        full = p + r + [0] * 8

        def checking(root, full=full):
            logits, greedy = block(root)
            n = dr.count
            assert root == full[n]  # the pending token sits right after the n context entries
            want = naive_block(model, drafter, runner, full[:n], root)
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
            assert torch.equal(greedy, want.argmax(-1))
            oracle = torch.tensor(full[n + 1:n + 6])  # (B-1,) the target's greedy drafts
            j = len(checked) % 6
            if j < 5:
                oracle[j] = (oracle[j] + 1) % 256  # first wrong draft at slot j: j accepted
            checked.append(n)
            return logits, oracle
        dr.block = checking
        out, s = dec.generate(p, 24)
        assert out == r
        accepted += s.accepted
    assert len(checked) > 20 and len(set(checked)) > 20
    assert set(accepted) == set(range(6))  # every accept count, up to the whole block, was followed by a check


def test_sampled_proposals_are_drawn_from_each_slot_law(setup):
    """At temperature > 0 each draft is drawn from its own slot's q_k (the target head over that slot, tempered and
    top-p filtered), and the Draft carries exactly those q's for the rejection rule."""
    model, runner, prompts, _ = setup
    drafter = make_dflash(model, block=5, seed=2, std=0.3)
    dr = DFlashDrafting(drafter.float(), runner.embed, runner.lm_head, slots=runner.cfg.max_seq)
    with torch.no_grad():
        hs = model(torch.tensor([prompts[3]]), output_hidden_states=True).hidden_states
    dr.extend(torch.cat([hs[a] for a in AUX], -1))
    logits, _ = dr.block(7)
    want = tree_mod.probs(logits[:4], 0.8, 0.9)  # (4,V)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4, want.shape[1])
    for _ in range(400):
        d = dr.propose_chain(7, 4, 0.8, 0.9, gen, want.shape[1])
        assert d.tokens[0] == 7 and len(d) == 5
        for j, q in enumerate(d.q[1:]):
            torch.testing.assert_close(q, want[j])
            assert want[j, d.tokens[j + 1]] > 0
            counts[j, d.tokens[j + 1]] += 1
    for j in range(4):  # each slot's empirical law is its own q_j (the slots differ from each other)
        stat, df = chi2(counts[j], want[j], 400)
        assert stat < chi2_critical(max(df, 1)), (j, stat, df)


# ---------------------------------------------------------------- the sampled law through SpecDecoder

@pytest.fixture(scope="module")
def small():
    V = 12
    model = peaky(make_tiny_llama(layers=4, hidden=32, heads=2, kv_heads=1, vocab=V, inter=64, seed=21), 8.0)
    runner = Runner.from_hf(model, max_batch=1, max_seq=32)
    drafter = make_dflash(model, block=4, seed=5, std=0.5, mask_token_id=0)  # confident, its law unlike the target's
    prompt = [3, 7, 1]
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V*V, 2): (x1, x2)
    seqs = torch.cat([torch.tensor(prompt).expand(V * V, -1), grid], 1)
    return model, runner, drafter, prompt, seqs, V


def sampled_stat(small, cfg, n=600):
    model, runner, drafter, prompt, seqs, V = small
    law2, law3 = exact_laws(model, prompt, seqs, V, cfg.temperature, cfg.top_p)
    dec = SpecDecoder(runner, drafter, cfg)
    assert isinstance(dec.drafting, DFlashDrafting)
    c2, c3 = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for seed in range(n):
        out, s = dec.generate(prompt, 3, seed=seed)
        c2[out[1]] += 1
        c3[out[2]] += 1
        accepted += sum(s.accepted)
    assert accepted > n // 10  # drafts are accepted often enough that the rejection rule is exercised
    (s2, d2), (s3, d3) = chi2(c2, law2, n), chi2(c3, law3, n)
    return s2 / chi2_critical(d2), s3 / chi2_critical(d3)


SAMPLED = [SpecConfig(method="chain", k=3, temperature=1.0), SpecConfig(method="chain", k=2, temperature=0.7, top_p=0.8)]


@pytest.mark.parametrize("cfg", SAMPLED, ids=["block", "block-top-p"])
def test_sampled_dflash_law_matches_target(small, cfg):
    r2, r3 = sampled_stat(small, cfg)
    assert r2 < 1 and r3 < 1, (r2, r3)


def test_broken_acceptance_rule_fails_the_dflash_law_test(small, monkeypatch):
    monkeypatch.setattr(tree_mod, "accept_sampled", lambda p, q, t, g: (True, p))
    r2, r3 = sampled_stat(small, SAMPLED[0])
    assert max(r2, r3) > 1, (r2, r3)


# ---------------------------------------------------------------- refusals

def test_dflash_refuses_trees_and_chains_longer_than_the_block(setup):
    model, runner, prompts, ref = setup
    d = make_dflash(model, block=6)
    for graph_round in (False, True):
        with pytest.raises(EyasError, match="not a tree"):
            SpecDecoder(runner, d, SpecConfig(method="tree", graph_round=graph_round))
        with pytest.raises(EyasError, match="B-1 = 5"):
            SpecDecoder(runner, d, SpecConfig(method="chain", k=6, graph_round=graph_round))
    dec = SpecDecoder(runner, d, SpecConfig(method="chain", k=5))  # k = B-1 is the longest accepted
    assert dec.generate(prompts[2], 24)[0] == ref[2]
    with pytest.raises(EyasError, match="target hidden size"):  # fit_drafter's shape check applies to DFlash too
        SpecDecoder(runner, make_dflash(make_tiny_llama(hidden=32, heads=2, kv_heads=1)), SpecConfig(k=2))
    lookup = SpecDecoder(runner, d, replace(SpecConfig(method="lookup", k=8)))  # drafter-free methods ignore it
    assert lookup.generate(prompts[2], 24)[0] == ref[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", [4, 16])
def test_cuda_graphed_dflash_equals_plain_greedy_and_the_cpu(setup, block):
    """On CUDA the block forward and the extends replay as CUDA graphs, or (graph_round) each whole round as one: in
    fp32 the tokens equal plain greedy's and the accepted counts equal the CPU eager decoder's, round by round."""
    model, cpu, prompts, ref = setup
    gpu = Runner.from_hf(model, max_batch=1, max_seq=160, device="cuda")
    drafter = make_dflash(model, block=block, seed=block, std=0.3)
    k = block - 1
    want = decode_all(SpecDecoder(cpu, drafter, SpecConfig(method="chain", k=k), fast=False), prompts)
    for graph_round, mode in ((False, "static"), (True, "round")):
        dec = SpecDecoder(gpu, drafter, SpecConfig(method="chain", k=k, graph_round=graph_round))
        assert dec.mode == mode
        outs, stats = decode_all(dec, prompts)
        assert outs == ref == want[0]
        assert [s.accepted for s in stats] == [s.accepted for s in want[1]]


@pytest.fixture(scope="module")
def fitted(setup):
    """A block-6 drafter fitted to the target's greedy replies, and the prompts of those replies: rounds accept
    every count from 0 to the whole block."""
    model, runner, _, _ = setup
    return fit_on_replies(model, runner, make_dflash(model, block=6, seed=6, std=0.02))


def host_and_round(runner, drafter, prompts, k):
    """(host-driven outputs and stats, one-graph-round outputs and stats, the round decoder) for `prompts`."""
    host = decode_all(SpecDecoder(runner, drafter, SpecConfig(method="chain", k=k), fast=True), prompts)
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=k, graph_round=True))
    assert dec.mode == "round" and isinstance(dec._round.drafting, DFlashDrafting)
    return host, decode_all(dec, prompts), dec


@pytest.mark.parametrize("k", [5, 2])
def test_one_graph_round_equals_plain_greedy_and_the_host_rounds(setup, fitted, k):
    """graph_round: round.py's chain body over DFlashDrafting's fixed-shape block and commit, eagerly on the CPU.
    Its tokens equal plain greedy's and its accepted counts equal the host-driven decoder's, round by round (a
    context entry written at the wrong position, or the bonus not written into the block's slot 0, changes
    them); acceptance covers 0 and the whole chain."""
    model, runner, prompts, ref = setup
    drafter, own = fitted
    cases = prompts + own
    want = ref + runner.generate(own, 24)
    (h_out, h_stats), (r_out, r_stats), _ = host_and_round(runner, drafter, cases, k)
    assert r_out == h_out == want
    assert [s.accepted for s in r_stats] == [s.accepted for s in h_stats]
    assert all(s.target_forwards == 1 + s.rounds and s.tokens == len(o) for s, o in zip(r_stats, r_out))
    acc = sum((s.accepted for s in r_stats), [])
    assert 0 in acc and k in acc and sum(acc) / len(acc) > 0.5


def test_a_round_that_commits_one_entry_too_few_is_caught(setup, fitted, monkeypatch):
    """The check above is sensitive to the commit: a round that counts acc entries instead of acc+1 (the drafter's
    context and the target's committed slots share the count) no longer decodes as plain greedy."""
    model, runner, prompts, ref = setup
    drafter, own = fitted

    def short(self, aux, tokens, acc):
        self._write(aux)
        self.n += acc.clamp(min=1)
    monkeypatch.setattr(DFlashDrafting, "commit", short)
    (h_out, h_stats), (r_out, r_stats), _ = host_and_round(runner, drafter, own, 5)
    assert h_out == runner.generate(own, 24) != r_out


def features(model, x):
    """The target's aux states (1, T, 3h) and final states (1, T, h) of the sequence x (1, T)."""
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in AUX], -1), hs[-1]


def fit_on_replies(model, runner, drafter, steps=150):
    """A few Adam steps of the training loss on the target's own greedy replies, every position an anchor: a
    drafter whose drafts land, so acceptance replays are not all zeros."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 255, (6,), generator=g).tolist() for _ in range(8)]
    rows = [p + o for p, o in zip(prompts, runner.generate(prompts, 40))]
    x = torch.tensor(rows)                                                           # (8, 46)
    aux, final = features(model, x)
    loss_mask = torch.arange(x.shape[1])[None].expand_as(x) >= 6
    anchors = torch.arange(5, x.shape[1] - 1)[None].expand(x.shape[0], -1)           # every round start
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):  # (the fit is judged on these same replies: it only has to make drafts land)
        o = dflash_forward(drafter, input_ids=x, loss_mask=loss_mask, valid=torch.ones_like(loss_mask), aux=aux,
                           final=final, embed=model.model.embed_tokens.weight, lm_head_weight=model.lm_head.weight,
                           cfg=BlockLossConfig(attention="dense"), anchors=anchors,
                           real=torch.ones_like(anchors, dtype=torch.bool))
        opt.zero_grad()
        o.loss.backward()
        opt.step()
    return drafter.eval(), prompts


@pytest.mark.parametrize("block", [4, 8])
def test_each_round_proposes_what_training_predicts_at_its_anchor(setup, block):
    """The train/serve contract end to end, on the target's own greedy reply: at every decoding round, the block the
    decoder proposes (after the committed tokens x_0..x_a, the bonus x_a at position a) equals the training path's
    prediction for the anchor a (train/dflash.block_hidden over the target's features of the whole sequence and the
    target's head), logits included; and the training loss's accepted length at each anchor equals the round's
    accepted count. An off-by-one in positions, context, mask row or head on either side breaks it."""
    model, runner, _, _ = setup
    drafter, prompts = fit_on_replies(model, runner, make_dflash(model, block=block, seed=block, std=0.02))
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=block - 1))
    rounds, block_fn = [], dec.drafting.block

    def spy(root):
        logits, greedy = block_fn(root)
        rounds.append((dec.drafting.count, root, logits.clone(), greedy.clone()))
        return logits, greedy
    dec.drafting.block = spy
    prompt = prompts[0]
    out, stats = dec.generate(prompt, 40)
    assert len(rounds) == stats.rounds and len(rounds) > 3
    x = torch.tensor([prompt + out])                                                 # (1, T)
    T, P = x.shape[1], len(prompt)
    aux, final = features(model, x)
    anchors = torch.tensor([[a for a, *_ in rounds]])                                # (1, N)
    assert anchors[0, 0] == P and all(x[0, a] == root for a, root, *_ in rounds)     # the bonus sits at a
    positions = torch.arange(T)[None]
    with torch.no_grad():
        h = block_hidden(drafter, input_ids=x, aux=aux, embed=model.model.embed_tokens.weight, anchors=anchors,
                         seg=torch.ones_like(x), positions=positions, flex=False)    # (1, N, B, h)
        train_logits = (h[0, :, 1:] @ model.lm_head.weight.T).float()                # (N, B-1, V)
    for n, (_, _, logits, greedy) in enumerate(rounds):
        torch.testing.assert_close(logits, train_logits[n], rtol=1e-4, atol=1e-4)
        assert greedy.tolist() == train_logits[n].argmax(-1).tolist()
    # the training loss's accepted lengths replay the rounds (blocks that end inside the sequence)
    loss_mask = positions >= P
    with torch.no_grad():
        o = dflash_forward(drafter, input_ids=x, loss_mask=loss_mask, valid=torch.ones_like(loss_mask), aux=aux,
                           final=final, embed=model.model.embed_tokens.weight, lm_head_weight=model.lm_head.weight,
                           cfg=BlockLossConfig(attention="dense"), anchors=anchors,
                           real=torch.ones_like(anchors, dtype=torch.bool))
    inside = [r for r, (a, *_) in enumerate(rounds) if a + block - 1 < T]
    assert [int(o.accept_len[0, rounds[r][0] - 1]) for r in inside] == [stats.accepted[r] for r in inside]
    assert sum(stats.accepted[r] for r in inside) > len(inside)   # drafts land: more than one per round on average
