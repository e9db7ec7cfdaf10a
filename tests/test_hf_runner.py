"""The generic runner (target/hf_runner.py) decodes a non-Llama target exactly: on the tiny DeepSeek-V3 twin (MLA
with its compressed-latent cache, MoE, YaRN), plain batched decoding, tree verification over arbitrary slots with
slot copies, and speculative decoding (chain, tree, prompt lookup) all equal the naive reference: an argmax loop
that runs the whole sequence through the HF model at every step, without a cache."""

import pytest
import torch

from support.models import make_tiny_llama
from support.deepseek_twin import make_twin
from eyas.decode.spec import SpecConfig, SpecDecoder
from eyas.errors import EyasError
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.target.hf_runner import HFRunner
from eyas.target.runner import Runner

AUX = (1, 3, 5)
TEXTS = ["Hello there, how are you today?", "Paris is the capital", "def main(): return 42",
         "The quick brown fox jumps over", "numbers 1234"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


@pytest.fixture(scope="module")
def twin():
    return make_twin()


_NAIVE: dict = {}


@torch.no_grad()
def naive_greedy(model, prompt, n, eos=()):
    """Uncached reference: the whole sequence through the model at every step, argmax of the last position
    (memoised per model and arguments: the parametrised tests share it)."""
    key = (id(model), tuple(prompt), n, tuple(eos))
    if key not in _NAIVE:
        _NAIVE[key] = _naive(model, prompt, n, eos)
    return _NAIVE[key]


def _naive(model, prompt, n, eos):
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t in eos:
            break
    return out


def test_from_hf_picks_the_generic_runner_for_non_llama_targets_with_a_note(twin, capsys):
    model, _ = twin
    r = Runner.from_hf(model, max_batch=1, max_seq=64, compile=True)
    assert isinstance(r, HFRunner) and not r.compiled
    err = capsys.readouterr().err
    assert "deepseek_v3" in err and "generic, eager, slow" in err and "compile ignored" in err
    assert r.cfg.num_layers == 7 and r.cfg.hidden_size == 64 and r.cfg.vocab_size == model.config.vocab_size
    assert isinstance(Runner.from_hf(make_tiny_llama(), max_seq=64), Runner)  # Llamas keep the fast runner


def test_batched_generate_equals_uncached_greedy(twin, monkeypatch):
    """Left-padded rows of unequal lengths, two chunks, rows ending at different eos steps and the compaction of
    the live rows (the runner's `move_rows`, which moves the rows of its slot cache)."""
    model, tok = twin
    prompts = [tok.encode(t) for t in TEXTS]
    eos = (198, 282)  # two of the first chunk's four rows end by step 9, so step 15 compacts the other two
    compacted = []
    real = HFRunner.move_rows
    monkeypatch.setattr(HFRunner, "move_rows", lambda r, live, L: compacted.append(live.tolist()) or real(r, live, L))
    r = HFRunner.from_hf(model, max_batch=4, max_seq=64)
    got = r.generate(prompts, 24, eos_ids=eos)
    assert got == [naive_greedy(model, p, 24, eos) for p in prompts]
    assert compacted and len({len(g) for g in got}) > 2


def test_tree_verify_and_slot_copies_equal_the_uncached_forward(twin):
    """One forward of a tree (siblings at one position in different slots) gives every node the logits and aux
    states of the uncached forward of its own path; after the accepted branch is copied next to the prefix, the
    next step continues from it as if it had been decoded alone."""
    model, tok = twin
    prefix = tok.encode("Speculative decoding drafts tokens")
    n = len(prefix)
    r = HFRunner.from_hf(model, max_batch=1, max_seq=64)
    q = torch.arange(n)
    r.forward(torch.tensor([prefix]), q[None], q[None], (q[None] <= q[:, None])[None])
    # root 0 at depth 0; 1 and 2 its children; 3 a child of 2
    tokens, depths, parent = [40, 62, 170, 287], [0, 1, 1, 2], [-1, 0, 0, 2]
    anc = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p >= 0:
            anc[i, p] = True
            p = parent[p]
    mask = torch.cat([torch.ones(4, n, dtype=torch.bool), anc], 1)[None]  # (1,4,n+4)
    slots = n + torch.arange(4)[None]
    logits, cap = r.forward(torch.tensor([tokens]), n + torch.tensor([depths]), slots, mask, capture=AUX + (7,))
    paths = [[0], [0, 1], [0, 2], [0, 2, 3]]
    with torch.no_grad():
        for i, path in enumerate(paths):
            out = model(torch.tensor([prefix + [tokens[j] for j in path]]), output_hidden_states=True)
            torch.testing.assert_close(logits[0, i], out.logits[0, -1], rtol=1e-5, atol=1e-5)
            for a in AUX + (7,):
                torch.testing.assert_close(cap[a][0, i], out.hidden_states[a][0, -1], rtol=1e-5, atol=1e-5)
    r.copy_slots(torch.tensor([n, n + 2, n + 3]), torch.tensor([n, n + 1, n + 2]))  # accept 0 -> 2 -> 3
    k = torch.arange(n + 4)
    nxt, _ = r.forward(torch.tensor([[5]]), torch.tensor([[n + 3]]), torch.tensor([[n + 3]]), (k <= n + 3)[None, None])
    with torch.no_grad():
        ref = model(torch.tensor([prefix + [40, 170, 287, 5]])).logits[0, -1]
    torch.testing.assert_close(nxt[0, -1], ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def drafter(twin):
    """A drafter trained for a few seconds on the twin's greedy text (step-0 objective), so drafts get accepted
    and trees accept branches other than the first."""
    model, tok = twin
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (4,), generator=g).tolist() for _ in range(16)]
    x = torch.tensor([p + o for p, o in zip(prompts, HFRunner.from_hf(model, max_batch=8, max_seq=64)
                                            .generate(prompts, 32))])  # (B,T)
    B, T = x.shape
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=len(tok), aux_layer_ids=AUX))
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in AUX], -1)  # (B,T,3h)
    emb = model.get_input_embeddings()(x).detach()
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    pos = torch.arange(T - 2)[None].expand(B, -1)
    mask = torch.ones(T - 2, T - 2, dtype=torch.bool).tril()[None].expand(B, -1, -1)
    for _ in range(60):
        out, _ = d.layer(d.fuse(aux[:, :-2]), emb[:, 1:-1], pos, mask)
        loss = torch.nn.functional.cross_entropy(d.logits(out)[:, 3:].flatten(0, 1), x[:, 5:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.mark.parametrize("method", ["chain", "tree", "lookup"])
def test_speculative_decoding_equals_uncached_greedy(twin, drafter, method, monkeypatch):
    model, tok = twin
    r = HFRunner.from_hf(model, max_batch=1, max_seq=96)
    moved = []
    real = r.copy_slots
    monkeypatch.setattr(r, "copy_slots", lambda s, d, row=0: moved.append(len(s)) or real(s, d, row))
    dec = SpecDecoder(r, None if method == "lookup" else drafter,
                      SpecConfig(method=method, k=4, top_k=3, depth=4, total_tokens=10))
    eos = (tok.eos_token_id,)
    forwards = tokens = 0
    for t in TEXTS[:4]:
        p = tok.encode(t)
        out, st = dec.generate(p, 28, eos_ids=eos)
        assert out == naive_greedy(model, p, 28, eos)
        forwards, tokens = forwards + st.target_forwards, tokens + st.tokens
    assert tokens / forwards > 1.3  # drafts were accepted: multi-token rounds were checked, not only bonus tokens
    assert bool(moved) == (method == "tree")  # trees accepted branches that were moved next to the prefix


def test_batched_chains_equal_uncached_greedy(twin, drafter):
    """The batched chain decoder (decode/batch.py: right-padded rows, per-row accept lengths, row moves through
    `runner.layers`) on the generic runner."""
    from eyas.decode.batch import BatchChainDecoder, BatchSpecConfig

    model, tok = twin
    prompts = [tok.encode(t) for t in TEXTS[:4]]
    r = HFRunner.from_hf(model, max_batch=4, max_seq=96)
    eos = (tok.eos_token_id, 287)  # rows end at different rounds
    outs, stats = BatchChainDecoder(r, drafter, BatchSpecConfig(k=3)).generate(prompts, 24, eos_ids=eos)
    assert outs == [naive_greedy(model, p, 24, eos) for p in prompts]
    assert sum(s.tokens for s in stats) > sum(s.target_forwards for s in stats)


def test_refuses_what_it_cannot_decode(twin, monkeypatch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sliding = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                           use_sliding_window=True, sliding_window=8, max_window_layers=1))
    with pytest.raises(EyasError, match="sliding_attention"):
        HFRunner.from_hf(sliding)
    r = HFRunner.from_hf(twin[0], max_batch=1, max_seq=16)
    one = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(EyasError, match="exceeds the cache"):
        r.forward(one.expand(2, 1), one.expand(2, 1), one.expand(2, 1), torch.ones(2, 1, 1, dtype=torch.bool))
    # a model whose layers keep their own cache would decode without the runner's slots: refused, not wrong
    monkeypatch.setattr(r.cache, "update", lambda k, v, *a, **kw: (k, v))
    with pytest.raises(EyasError, match="wrote the cache from 0 of its 7 layers"):
        r.forward(one, one, one, torch.ones(1, 1, 1, dtype=torch.bool))


def test_a_bench_on_a_generic_target_lets_the_model_go():
    """The bench keeps its runners per target model in a weak map; a generic runner holds that model, so it is not
    kept there (it would keep the model, its own key, alive for the whole process)."""
    import gc
    import io
    import weakref

    from eyas.bench.bench import BenchConfig, run_bench
    from eyas.target import target_from_model

    model, tok = make_twin(layers=3)
    rep = run_bench(BenchConfig(max_new_tokens=4, max_seq=64, baselines=True, k=2), target=target_from_model(model, tok),
                    records=[{"turns": ["Hello there"]}], out=io.StringIO())
    assert rep["methods"]["plain"]["tokens"] == 4
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
