"""Speculative decoding is lossless: greedy equality with plain decoding, and a chi-square test of the
sampled law (which a deliberately broken acceptance rule fails)."""

import math
from dataclasses import replace

import pytest
import torch

from support.models import make_tiny_llama
from support.drafters import eagle3_for_model
from eyas.decode import tree as tree_mod
from eyas.decode.lookup import lookup
from eyas.target.sampling import probs
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.errors import EyasError
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.target.runner import Runner

AUX = (1, 2, 3)


def peaky(model, scale, layer_scale=1.0):
    """Sharpen the target's law (lm_head * scale); layer_scale < 1 shrinks the layers' residual
    writes so the next token depends mostly on the current one (an easier target to draft for)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    return model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def train_drafter(model, runner, steps=150, seed=0):
    """A few hundred Adam steps of the step-0 EAGLE objective on the target's own greedy text."""
    d = eagle3_for_model(model, seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (4,), generator=g).tolist() for _ in range(24)]
    x = torch.tensor([p + o for p, o in zip(prompts, runner.generate(prompts, 40))])  # (B,T)
    B, T = x.shape
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in AUX], -1)  # (B,T,3h)
    emb = model.get_input_embeddings()(x).detach()
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    pos = torch.arange(T - 2)[None].expand(B, -1)
    mask = torch.ones(T - 2, T - 2, dtype=torch.bool).tril()[None].expand(B, -1, -1)
    for _ in range(steps):
        out, _ = d.layer(d.fuse(aux[:, :-2]), emb[:, 1:-1], pos, mask)
        loss = torch.nn.functional.cross_entropy(d.logits(out)[:, 3:].flatten(0, 1), x[:, 5:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.fixture(scope="module")
def setup():
    model = peaky(make_tiny_llama(seed=11), 4.0, 0.3)
    runner = Runner.from_hf(model, max_batch=8, max_seq=320)
    trained = train_drafter(model, runner)
    g = torch.Generator().manual_seed(1)
    lengths = [1, 2, 3, 5, 8] + torch.randint(4, 40, (40,), generator=g).tolist() + [120, 150, 200, 230, 240]
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    free = runner.generate(prompts, 24)
    counts = torch.bincount(torch.tensor(sum(free, [])), minlength=256)
    eos = int(counts.argmax())  # a token many greedy continuations reach
    ref = runner.generate(prompts, 24, eos_ids=[eos])
    return model, runner, trained, prompts, ref, eos


def run_all(runner, drafter, cfg, prompts, eos):
    return run_all_dec(SpecDecoder(runner, drafter, cfg), prompts, eos)


def test_reference_hits_eos_and_long_prompts(setup):
    _, _, _, prompts, ref, eos = setup
    assert len(prompts) >= 50 and max(map(len, prompts)) >= 200
    assert sum(o[-1] == eos and len(o) < 24 for o in ref) >= 5
    assert sum(len(o) == 24 for o in ref) >= 5


CONFIGS = {"chain4": SpecConfig(method="chain", k=4), "chain1": SpecConfig(method="chain", k=1),
           "tree": SpecConfig(method="tree", top_k=4, depth=5, total_tokens=16),
           "lookup": SpecConfig(method="lookup", k=4), "plain": SpecConfig(method="plain")}
MODES = [(name, mode) for name in ("chain4", "chain1", "tree") for mode in ("eager", "static", "round")] + \
    [("lookup", "draftless"), ("plain", "draftless")]
"""Every greedy way to decode: the eager reference drafter, the static drafter cache (one CUDA graph per call on
CUDA, run eagerly here) and the one-graph round, for chains and trees; the drafter-free methods."""


def mode_decoder(runner, drafter, name: str, mode: str) -> SpecDecoder:
    cfg = CONFIGS[name]
    if mode == "round":
        return SpecDecoder(runner, drafter, replace(cfg, graph_round=True))
    return SpecDecoder(runner, drafter, cfg, fast=mode == "static")


_accepted: dict = {}


def eager_accepted(setup, name) -> list[list[int]]:
    """Per prompt, the eager reference drafter's accepted counts per round."""
    if name not in _accepted:
        _, runner, trained, prompts, _, eos = setup
        dec = mode_decoder(runner, trained, name, "eager")
        _accepted[name] = [dec.generate(p, 24, eos_ids=[eos])[1].accepted for p in prompts]
    return _accepted[name]


@pytest.mark.parametrize("name,mode", MODES, ids=[f"{n}-{m}" for n, m in MODES])
def test_greedy_speculative_equals_target_greedy(setup, name, mode):
    """Lossless in every mode; the static cache and the round also accept, round by round, what the eager reference
    accepts (they draft the same tokens)."""
    model, runner, trained, prompts, ref, eos = setup
    cfg = CONFIGS[name]
    dec = mode_decoder(runner, trained, name, mode)
    assert dec.mode == mode
    outs, stats, accepted = [], None, []
    for p in prompts:
        o, s = dec.generate(p, 24, eos_ids=[eos])
        outs.append(o)
        accepted.append(list(s.accepted))  # before `add` extends the first stats in place
        stats = s if stats is None else (stats.add(s) or stats)
    assert outs == ref
    assert stats.tokens == sum(map(len, ref))
    assert stats.target_forwards == len(prompts) + sum(map(len, accepted))
    if cfg.method == "plain":
        assert stats.tau == 1.0
    else:  # acceptance is non-trivial, so the accept/compaction/continuation paths were exercised
        assert stats.tau > 1.1, stats.tau
        assert stats.accepted_at[0] > 0 and (cfg.k == 1 or stats.accepted_at[1] > 0)
    if mode in ("static", "round"):
        assert accepted == eager_accepted(setup, name)


def run_all_dec(dec, prompts, eos):
    outs, stats = [], None
    for p in prompts:
        o, s = dec.generate(p, 24, eos_ids=[eos])
        outs.append(o)
        stats = s if stats is None else (stats.add(s) or stats)
    return outs, stats


def test_greedy_default_tree_and_untrained_drafter_with_small_draft_vocab(setup):
    model, runner, _, prompts, ref, eos = setup
    untrained = eagle3_for_model(model, seed=3, draft_vocab=100)
    for cfg in (SpecConfig(method="tree"), SpecConfig(method="chain", k=3)):
        outs, _ = run_all(runner, untrained, cfg, prompts[::5], eos)
        assert outs == ref[::5]


def test_lookup_verifies_at_two_shapes_and_stays_exact(setup, monkeypatch):
    """Prompt lookup proposes 0..K tokens; every non-empty draft is padded to K+1 rows, so the runner holds exactly
    two lookup shapes (S = 1 through the verify step on the CPU; on CUDA the plain step, tests/test_runner.py), and
    the output is still the target's greedy one. The fillers' cache slots are overwritten with noise after every
    verify: if a later round read one before rewriting it, the tokens would change."""
    model, _, _, prompts, ref, eos = setup
    runner = Runner.from_hf(model, max_batch=1, max_seq=320)   # fresh: no shapes yet
    sizes, padded = [], SpecDecoder._padded
    monkeypatch.setattr(SpecDecoder, "_padded", lambda self, S: sizes.append(S) or padded(self, S))
    graphed, g = runner.graphed, torch.Generator().manual_seed(0)

    def poisoning(batch, seq, fn=None, slots=None):
        step = graphed(batch, seq, fn, slots)

        def run(ids, pos, slot, mask):
            out = step(ids, pos, slot, mask)
            real = mask[0, :, :int(slot[0, 0])].any(-1)  # draft rows see the committed prefix, fillers do not
            dead = slot[0, ~real]
            for layer in runner.layers:
                for c in (layer.k_cache, layer.v_cache):
                    c[0, :, dead] = 30 * torch.randn(c[0, :, dead].shape, generator=g)
            return out
        return run
    runner.graphed = poisoning
    outs, _ = run_all(runner, None, SpecConfig(method="lookup", k=4), prompts[::2], eos)
    assert outs == ref[::2]
    assert {1, 5} <= set(sizes) and set(sizes) - {1, 5}, sorted(set(sizes))  # empty, full and partial drafts ran
    step = runner.step_fn(())
    assert {(b, s, fn) for b, s, fn, *_ in graphed.__self__._graphs} == {(1, 1, step), (1, 5, step)}
    assert graphed.__self__.graph_count == 2


def test_lookup_proposals():
    assert lookup([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert lookup([5, 6, 7, 5, 6], 3) == [7, 5, 6]
    assert lookup([1, 2, 3], 3) == []


def test_bad_input_refused(setup):
    model, runner, trained, *_ = setup
    with pytest.raises(EyasError):
        SpecConfig(temperature=-0.5)
    with pytest.raises(EyasError):
        SpecDecoder(runner, trained, SpecConfig(method="tree", total_tokens=400))
    with pytest.raises(EyasError):
        SpecDecoder(runner, None, SpecConfig(method="chain"))
    with pytest.raises(EyasError):
        SpecDecoder(runner, trained, SpecConfig(method="chain")).generate([5] * 300, 24)


# ---------------------------------------------------------------- the sampled law

def chi2_critical(df, z=3.09):
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, expected_p, n):
    exp = expected_p * n
    keep = exp >= 5
    lump_o, lump_e = counts[~keep].sum(), exp[~keep].sum()
    stat = float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    if lump_e >= 5:
        stat += float((lump_o - lump_e) ** 2 / lump_e)
        df += 1
    return stat, df


@pytest.fixture(scope="module")
def small():
    V = 12
    model = peaky(make_tiny_llama(layers=4, hidden=32, heads=2, kv_heads=1, vocab=V, inter=64, seed=21), 8.0)
    runner = Runner.from_hf(model, max_batch=1, max_seq=32)
    drafter = eagle3_for_model(model, seed=5)
    with torch.no_grad():  # a confident drafter whose law differs from the target's
        drafter.lm_head.weight.normal_(0, 1.0)
    prompt = [3, 7, 1]
    with torch.no_grad():
        grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V*V, 2): (x1, x2)
        seqs = torch.cat([torch.tensor(prompt).expand(V * V, -1), grid], 1)
        return model, runner, drafter, prompt, seqs, V


def exact_laws(model, prompt, seqs, V, temperature, top_p):
    """Exact marginal laws of the 2nd and 3rd generated tokens under (temperature, top_p)."""
    with torch.no_grad():
        lg = model(seqs).logits  # (V*V, n+2, V)
    n = len(prompt)
    p1 = probs(lg[0, n - 1], temperature, top_p)  # (V,)
    p2 = probs(lg[::V, n], temperature, top_p)  # (V, V): row x1
    p3 = probs(lg[:, n + 1], temperature, top_p).view(V, V, V)  # [x1, x2, x3]
    law2 = (p1[:, None] * p2).sum(0)
    law3 = (p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1))
    return law2, law3


def sampled_stat(small, cfg, n=600):
    model, runner, drafter, prompt, seqs, V = small
    law2, law3 = exact_laws(model, prompt, seqs, V, cfg.temperature, cfg.top_p)
    dec = SpecDecoder(runner, drafter, cfg)
    c2, c3 = torch.zeros(V), torch.zeros(V)
    for seed in range(n):
        out, _ = dec.generate(prompt, 3, seed=seed)
        c2[out[1]] += 1
        c3[out[2]] += 1
    (s2, d2), (s3, d3) = chi2(c2, law2, n), chi2(c3, law3, n)
    return s2 / chi2_critical(d2), s3 / chi2_critical(d3)


SAMPLED = [SpecConfig(method="chain", k=2, temperature=1.0), SpecConfig(method="tree", top_k=3, depth=2,
           total_tokens=5, temperature=1.0), SpecConfig(method="chain", k=2, temperature=0.7, top_p=0.8)]


@pytest.mark.parametrize("cfg", SAMPLED, ids=["chain", "tree", "chain-top-p"])
def test_sampled_law_matches_target(small, cfg):
    r2, r3 = sampled_stat(small, cfg)
    assert r2 < 1 and r3 < 1, (r2, r3)


@pytest.mark.parametrize("cfg", SAMPLED[:2], ids=["chain", "tree"])
def test_broken_acceptance_rule_fails_the_law_test(small, cfg, monkeypatch):
    monkeypatch.setattr(tree_mod, "accept_sampled", lambda p, q, t, g: (True, p))
    monkeypatch.setattr(tree_mod, "accept_fixed", lambda p, t, g: (True, p))
    r2, r3 = sampled_stat(small, cfg)
    assert max(r2, r3) > 1, (r2, r3)


def test_export_import_round_trip_gives_same_speculative_output_and_tau(setup, tmp_path):
    """train -> export (fp32) -> import: the imported drafter decodes exactly like the trained one."""
    from eyas.export.export import export_drafter
    from eyas.model.importer import load_eagle3_checkpoint

    model, runner, trained, prompts, ref, eos = setup
    out = export_drafter(trained, tmp_path / "export", dtype="fp32")
    imported, _ = load_eagle3_checkpoint(out)
    for name, p in trained.state_dict().items():
        assert torch.equal(p, imported.state_dict()[name]), name
    cfg = SpecConfig(method="chain", k=4)
    a, sa = run_all(runner, trained, cfg, prompts[:20], eos)
    b, sb = run_all(runner, imported, cfg, prompts[:20], eos)
    assert a == b == ref[:20]
    assert sa.tau == sb.tau and sa.accepted_at == sb.accepted_at
    assert sa.tau > 1.05  # a drafter that is accepted sometimes, so the comparison is not vacuous
