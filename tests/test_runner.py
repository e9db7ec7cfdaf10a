"""The static-cache runner against HF: logits, incremental decode, padding, hidden states, greedy generate."""

import pytest
import torch

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.target.runner import Runner


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def causal_mask(S, L, start=0):
    q = torch.arange(start, start + S)[:, None]
    return (torch.arange(L)[None] <= q)[None]  # (1,S,L)


def prefill_decode_tree_match_hf(step, model, slots: int = 64):
    """Through `step` (a runner's decode function), HF's logits in fp32 for: a 12-token prefill, 4 one-token steps
    over the whole cache, then a 3-node tree over non-contiguous slots (siblings at position 16 in slots 16 and
    17, a child of the second at 17)."""
    ids = torch.randint(3, 256, (1, 20))
    ref = model(ids).logits
    pos = torch.arange(12)[None]
    torch.testing.assert_close(step(ids[:, :12], pos, pos, causal_mask(12, slots)), ref[:, :12], atol=1e-5, rtol=1e-5)
    for t in range(12, 16):
        p = torch.tensor([[t]])
        torch.testing.assert_close(step(ids[:, t:t + 1], p, p, causal_mask(1, slots, t))[:, 0], ref[:, t],
                                   atol=1e-5, rtol=1e-5)
    toks = torch.tensor([[ids[0, 16], 77, ids[0, 17]]])
    mask = torch.zeros(1, 3, slots, dtype=torch.bool)
    mask[0, :, :16] = True
    mask[0, 0, 16] = mask[0, 1, 17] = mask[0, 2, 17] = mask[0, 2, 18] = True
    out = step(toks, torch.tensor([[16, 16, 17]]), torch.tensor([[16, 17, 18]]), mask)
    seq2 = torch.cat([ids[:, :16], torch.tensor([[77, ids[0, 17]]])], 1)
    torch.testing.assert_close(out[0, 0], ref[0, 16], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 2], model(seq2).logits[0, 17], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 8])
def test_gemv_projections_equal_hf(rows, monkeypatch):
    """gemv=R: inside compiled steps of <= R rows (batch x tokens) the projections are `rowwise_linear`, and the
    logits are HF's (fp32): one-token decode, and with R = 8 a 3-node tree step; the 12-token prefill and every
    eager call keep nn.Linear. rowwise_linear itself equals F.linear."""
    import torch.nn.functional as F

    from eyas.target import runner as runner_mod

    x, w = torch.randn(3, 5, 64), torch.randn(96, 64)
    torch.testing.assert_close(runner_mod.rowwise_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    traced, real = [], runner_mod.rowwise_linear
    monkeypatch.setattr(runner_mod, "rowwise_linear", lambda x, w: traced.append(x.shape[:-1].numel()) or real(x, w))
    torch._dynamo.reset()  # trace afresh, so the spy sees what the compiled steps call
    model = make_tiny_llama(seed=5)
    r = Runner.from_hf(model, max_batch=2, max_seq=64, gemv=rows, compile=True)
    assert all(layer.gemv == rows for layer in r.layers)
    prefill_decode_tree_match_hf(r._compiled, model)
    n = 4 * len(r.layers)  # projections per step
    assert sorted(set(traced)) == ([1] if rows == 1 else [1, 3]) and len(traced) % n == 0, traced
    traced.clear()
    p = torch.tensor([[16]])
    r._decode(torch.tensor([[5]]), p, p, torch.ones(1, 1, 64, dtype=torch.bool))  # eager: nn.Linear
    assert traced == []
    with pytest.raises(EyasError, match="gemv -1"):
        Runner.from_hf(model, max_batch=1, max_seq=8, gemv=-1)
    with pytest.raises(EyasError, match="gemv needs compile"):
        Runner.from_hf(model, max_batch=1, max_seq=8, gemv=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gemv_default_is_the_cuda_static_compile(device):
    """gemv unset: 1 for a static-shape whole-model compile with matmul attention on CUDA (measured faster there);
    0 eagerly, with dynamic shapes, regions or flex, and on the CPU (compiling builds nothing until a step runs, so
    this needs no trace)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = make_tiny_llama(seed=5).to(device)
    gemv = lambda **kw: Runner.from_hf(model, max_batch=1, max_seq=16, **kw).layers[0].gemv  # noqa: E731
    assert gemv(compile=True) == (1 if device == "cuda" else 0)
    assert gemv() == 0 and gemv(compile=True, dynamic=True) == 0 and gemv(compile=True, gemv=0) == 0
    assert gemv(compile=True, regions=True) == 0 and gemv(compile=True, attention="flex") == 0
    assert gemv(compile=True, gemv=8) == 8


@pytest.mark.parametrize("tie", [False, True])
def test_prefill_and_decode_logits_match_hf(tie):
    model = make_tiny_llama(tie=tie, seed=1)
    r = Runner.from_hf(model, max_batch=2, max_seq=64)
    ids = torch.randint(3, 256, (1, 20))
    ref = model(ids).logits
    pos = torch.arange(12)[None]
    out, _ = r(ids[:, :12], pos, pos, causal_mask(12, 12))
    torch.testing.assert_close(out, ref[:, :12], atol=1e-5, rtol=1e-5)
    for t in range(12, 20):  # incremental decode, one token at a time, full-length mask
        p = torch.tensor([[t]])
        out, _ = r(ids[:, t:t + 1], p, p, causal_mask(1, 64, t))
        torch.testing.assert_close(out[:, 0], ref[:, t], atol=1e-5, rtol=1e-5)


def test_left_padded_batch_matches_unpadded_hf():
    model = make_tiny_llama(seed=2)
    r = Runner.from_hf(model, max_batch=2, max_seq=32)
    a, b = torch.randint(3, 256, (10,)), torch.randint(3, 256, (6,))
    ids = torch.zeros(2, 10, dtype=torch.long)
    ids[0], ids[1, 4:] = a, b
    pos = torch.stack([torch.arange(10), (torch.arange(10) - 4).clamp(min=0)])
    real = torch.stack([torch.ones(10, dtype=torch.bool), torch.arange(10) >= 4])
    mask = causal_mask(10, 10) & real[:, None, :] | torch.eye(10, dtype=torch.bool)[None]
    out, _ = r(ids, pos, torch.arange(10)[None].expand(2, -1), mask)
    torch.testing.assert_close(out[0], model(a[None]).logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 4:], model(b[None]).logits[0], atol=1e-5, rtol=1e-5)


def test_captured_hidden_states_match_hf_indices():
    model = make_tiny_llama(layers=5, seed=3)
    r = Runner.from_hf(model, max_batch=1, max_seq=16)
    ids = torch.randint(3, 256, (1, 9))
    hs = model(ids, output_hidden_states=True).hidden_states
    pos = torch.arange(9)[None]
    final, cap = r(ids, pos, pos, causal_mask(9, 9), capture=(0, 1, 2, 4, 5), logits=False)
    for i in (0, 1, 2, 4, 5):
        torch.testing.assert_close(cap[i], hs[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, hs[5], atol=1e-5, rtol=1e-5)


def test_tree_mask_and_slot_compaction():
    """A query that attends a non-contiguous set of slots equals HF on that sub-sequence."""
    model = make_tiny_llama(seed=4)
    r = Runner.from_hf(model, max_batch=1, max_seq=32)
    ids = torch.randint(3, 256, (1, 8))
    pos = torch.arange(5)[None]
    r(ids[:, :5], pos, pos, causal_mask(5, 5))
    # two siblings at position 5 in slots 5 and 6, a child of the second at position 6 in slot 7
    toks = torch.tensor([[ids[0, 5], 77, ids[0, 6]]])
    mask = torch.zeros(1, 3, 32, dtype=torch.bool)
    mask[0, :, :5] = True
    mask[0, 0, 5] = mask[0, 1, 6] = True
    mask[0, 2, 6] = mask[0, 2, 7] = True
    out, _ = r(toks, torch.tensor([[5, 5, 6]]), torch.tensor([[5, 6, 7]]), mask)
    seq2 = torch.cat([ids[:, :5], torch.tensor([[77, ids[0, 6]]])], 1)
    torch.testing.assert_close(out[0, 0], model(ids[:, :6]).logits[0, 5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 2], model(seq2).logits[0, 6], atol=1e-5, rtol=1e-5)
    r.copy_slots(torch.tensor([6, 7]), torch.tensor([5, 6]))  # keep the path 77 -> ids[6]
    out, _ = r(ids[:, 7:8], torch.tensor([[7]]), torch.tensor([[7]]), causal_mask(1, 32, 7))
    seq3 = torch.cat([seq2, ids[:, 7:8]], 1)
    torch.testing.assert_close(out[0, 0], model(seq3).logits[0, 7], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_equals_hf_and_the_matmul_path(compiled, request):
    """attention="flex": prefill, one-token decode over the whole cache and a tree mask over non-contiguous slots
    give HF's logits (fp32); greedy generation gives the matmul runner's tokens. Compiled on the CPU too (the
    mask reaches flex as a graph input)."""
    model = make_tiny_llama(seed=1)
    r = Runner.from_hf(model, max_batch=2, max_seq=64, attention="flex", compile=compiled)
    step = r._compiled if compiled else r._decode
    if compiled:  # torch 2.13: after a flex compile, a compile-regions trace in the same process fails inside
        request.addfinalizer(torch._dynamo.reset)  # dynamo (KeyError in invoke_subgraph); leave a clean slate
    assert all(layer.flex for layer in r.layers)
    prefill_decode_tree_match_hf(step, model)
    if not compiled:  # the CPU runner compiles a new shape per window; the eager one is enough here
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 2)]
        assert r.generate(prompts, 12) == Runner.from_hf(model, max_batch=2, max_seq=64).generate(prompts, 12)
    with pytest.raises(EyasError, match="attention 'sdpa'"):
        Runner.from_hf(model, max_batch=1, max_seq=8, attention="sdpa")
    with pytest.raises(EyasError, match="flex attention inside compile regions"):
        Runner.from_hf(model, max_batch=1, max_seq=8, attention="flex", compile=True, regions=True)


@pytest.mark.parametrize("tie", [False, True])
def test_greedy_generate_equals_hf_generate(tie):
    model = make_tiny_llama(tie=tie, seed=5)
    model.generation_config.pad_token_id = 0
    r = Runner.from_hf(model, max_batch=3, max_seq=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 11, 7, 20, 1)]
    ours = r.generate(prompts, 12, eos_ids=[2])
    for p, o in zip(prompts, ours):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=2,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        if 2 in ref:
            ref = ref[:ref.index(2) + 1]
        assert o == ref


def test_generate_stops_at_eos_and_rejects_bad_input():
    model = make_tiny_llama(seed=6)
    r = Runner.from_hf(model, max_batch=2, max_seq=32)
    free = r.generate([[5, 6, 7]], 10)[0]
    stop = r.generate([[5, 6, 7]], 10, eos_ids=[free[3]])[0]
    assert stop == free[:free.index(free[3]) + 1]
    assert len(r.generate([[5] * 28], 10)[0]) == 4  # the cache row is full after 32 slots
    with pytest.raises(EyasError):
        r.generate([[5] * 40], 3)
    with pytest.raises(EyasError):
        r.generate([[5]], 3, temperature=-1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_stops_within_a_step_of_the_last_eos(device):
    """Decoding ends once every row has met an eos: no decode step after it on the CPU, at most one on CUDA (the
    flag is read one step late), where a check every 16 steps ran up to 15 more; the tokens are unchanged."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = make_tiny_llama(seed=6).to(device)
    r = Runner.from_hf(model, max_batch=2, max_seq=64)
    free = r.generate([[5, 6, 7], [8, 9]], 40)
    eos = {free[0][3], free[1][5]}
    want = [f[:next(i for i, t in enumerate(f) if t in eos) + 1] for f in free]
    assert max(map(len, want)) <= 6, "both rows must stop early for this test to say anything"
    calls, graphed = [], r.graphed

    def counting(*a, **kw):
        step = graphed(*a, **kw)
        return lambda *x: calls.append(1) or step(*x)
    r.graphed = counting
    assert r.generate([[5, 6, 7], [8, 9]], 40, eos_ids=sorted(eos)) == want
    last = max(map(len, want)) - 1  # decode steps that produced a kept token (the first comes from the prefill)
    assert last <= len(calls) <= last + (device == "cuda"), (len(calls), last)


def test_sampled_generate_is_seeded_and_batch_independent_in_distribution():
    model = make_tiny_llama(seed=7)
    r = Runner.from_hf(model, max_batch=4, max_seq=32)
    a = r.generate([[5, 6], [9, 9, 9]], 8, temperature=1.0, seed=3)
    b = r.generate([[5, 6], [9, 9, 9]], 8, temperature=1.0, seed=3)
    assert a == b and len(a[0]) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True, "regions", "flex", "gemv", "gemv8"])
def test_cuda_graphed_generate_and_speculative_equal_eager_cpu(compile):
    from eyas.decode.spec import SpecConfig, SpecDecoder
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    model = make_tiny_llama(seed=8)
    cpu = Runner.from_hf(model, max_batch=4, max_seq=96)
    gpu = Runner.from_hf(model, max_batch=4, max_seq=96, device="cuda", compile=bool(compile),
                         regions=compile == "regions", attention="flex" if compile == "flex" else "matmul",
                         gemv={"gemv": 1, "gemv8": 8}.get(compile, 0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 2, 30, 9)]
    ref = cpu.generate(prompts, 20, eos_ids=[2])
    assert gpu.generate(prompts, 20, eos_ids=[2]) == ref
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=256, aux_layer_ids=(1, 2, 3)))
    for cfg in (SpecConfig(method="chain", k=3), SpecConfig(method="tree", top_k=3, depth=3, total_tokens=8),
                SpecConfig(method="lookup", k=3)):
        dec = SpecDecoder(gpu, drafter, cfg)
        assert [dec.generate(p, 20, eos_ids=[2])[0] for p in prompts] == ref


def ragged_case(runner):
    """12 prompts of 2-30 tokens and eos ids taken from early tokens of most rows' free replies, so the rows of a
    batch finish at different times and a long tail stays (compaction and windows get exercised)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2, 11, 23, 8, 14, 3, 19, 6)]
    free = runner.generate(prompts, 48)
    return prompts, sorted({row[j] for row, j in zip(free, (1, 2, 3, 4, 6, 8, 10, 12)) if len(row) > j})


def test_compacted_windowed_generate_equals_one_prompt_at_a_time():
    """Moving the live rows to the front once half the batch has finished, and attending over a window of
    slots, leaves every row's greedy tokens as if it had been decoded alone (mutation: copying only the key
    cache, or keeping the stale row order, changes them)."""
    model = make_tiny_llama(seed=7)
    r = Runner.from_hf(model, max_batch=12, max_seq=96)
    prompts, eos = ragged_case(r)
    ours = r.generate(prompts, 48, eos_ids=eos, window=8)
    assert any(k[0] < 12 for k in r._graphs), "no compaction happened: the test would prove nothing"
    lengths = sorted(len(o) for o in ours)
    assert lengths[len(lengths) // 2] < 16 < lengths[-1], lengths  # most stop early, some run on
    plain = r.generate(prompts, 48, eos_ids=eos, window=0, compact=False)
    alone = [r.generate([p], 48, eos_ids=eos)[0] for p in prompts]
    assert ours == plain == alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("regions", [False, True])
def test_cuda_dynamic_compiled_generate_equals_eager_cpu(regions):
    """Regeneration's compiled runner (--regen-compile: one dynamic-shape compile for every batch and window)
    decodes the same greedy tokens as the CPU, through compaction (batch 12 -> 8 -> 4 ...) and windows, and
    compiles once for those shapes, not once per shape."""
    from torch._dynamo.utils import counters

    model = make_tiny_llama(seed=7)
    cpu = Runner.from_hf(model, max_batch=12, max_seq=96)
    prompts, eos = ragged_case(cpu)
    ref = cpu.generate(prompts, 48, eos_ids=eos, window=8)
    gpu = Runner.from_hf(model, max_batch=12, max_seq=96, device="cuda", compile=True, dynamic=True, regions=regions)
    counters.clear()
    assert gpu.generate(prompts, 48, eos_ids=eos, window=8) == ref
    # A second length gives another window (slots 56, not 80): on the H200 the first call alone captured only
    # (12, 80) and (1, 80), too few shapes to tell one compile per shape from one for all.
    assert gpu.generate(prompts, 24, eos_ids=eos, window=8) == cpu.generate(prompts, 24, eos_ids=eos, window=8)
    shapes = {(k[0], k[3]) for k in gpu._graphs}          # (batch, slots) of each captured step
    assert any(b < 12 for b, _ in shapes) and len({s for _, s in shapes}) >= 2, shapes  # compaction and 2 windows
    assert counters["stats"]["unique_graphs"] < len(shapes), (dict(counters["stats"]), shapes)  # not one per shape


def _invoke_subgraphs(gm) -> tuple[int, int]:
    """(invoke_subgraph calls, distinct subgraphs they call) in a dynamo graph."""
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    return len(calls), len({n.args[0].target for n in calls})


def test_compile_regions_trace_one_layer_body_for_all_layers():
    """With regions, the graph dynamo hands the compiler calls ONE layer subgraph once per layer (so inductor
    compiles the layer once); without them the N layers are unrolled and there is no subgraph."""
    model = make_tiny_llama(layers=5, seed=4)
    ids, pos = torch.tensor([[5, 9, 7]]), torch.arange(3)[None]
    for regions, want in ((True, (5, 1)), (False, (0, 0))):
        r = Runner.from_hf(model, max_batch=1, max_seq=16, compile=True, regions=regions)
        graphs = []
        fn = torch.compile(r._decode, fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm.forward)
        fn(ids, pos, pos.clone(), causal_mask(3, 16))
        assert len(graphs) == 1 and _invoke_subgraphs(graphs[0]) == want


def test_compile_regions_decode_the_eager_tokens():
    """The region-compiled runner (inductor, CPU) decodes the eager runner's greedy tokens, plain and as the
    target of a speculative chain (its capture step compiled the same way), and its cache writes land (the
    cache is mutated inside the region): a wrong cache would change the continuation."""
    from eyas.decode.spec import SpecConfig, SpecDecoder
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    model = make_tiny_llama(seed=8)
    eager = Runner.from_hf(model, max_batch=1, max_seq=64)
    # dynamic: on the CPU a decode step attends exactly the used slots, a new shape per token
    comp = Runner.from_hf(model, max_batch=1, max_seq=64, compile=True, dynamic=True, regions=True)
    prompts = [[5, 17, 2, 30, 9], [44, 3]]
    ref = [eager.generate([p], 12, window=0)[0] for p in prompts]
    assert [comp.generate([p], 12, window=0)[0] for p in prompts] == ref
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=256, aux_layer_ids=(1, 2, 3)))
    dec = SpecDecoder(comp, drafter, SpecConfig(method="chain", k=3))
    assert [dec.generate(p, 12)[0] for p in prompts] == ref


def test_compile_regions_without_compile_change_nothing():
    model = make_tiny_llama(seed=2)
    r = Runner.from_hf(model, max_batch=1, max_seq=16, regions=True)  # eager: the plain layer call
    assert r._compiled is None and r._call_layer.__name__ == "_layer_body"


def test_compile_options_reach_inductor_and_keep_the_tokens(monkeypatch):
    """compile_options go to torch.compile as inductor options (benchmarks.compile_variants measures them); the
    compiled runner still decodes the eager tokens; an option inductor does not know is refused at construction."""
    model = make_tiny_llama(seed=9)
    eager = Runner.from_hf(model, max_batch=1, max_seq=48)
    seen = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw.get("options")) or real(fn, **kw))
    opts = {"coordinate_descent_tuning": True, "epilogue_fusion": True}
    # dynamic: on the CPU a decode step attends exactly the used slots, a new shape per token
    comp = Runner.from_hf(model, max_batch=1, max_seq=48, compile=True, dynamic=True, compile_options=opts)
    assert seen == [opts]
    prompt = [5, 17, 2, 30, 9]
    assert comp.generate([prompt], 10)[0] == eager.generate([prompt], 10)[0]
    with pytest.raises(EyasError, match="unknown inductor option.*no_such_knob"):
        Runner.from_hf(model, max_batch=1, max_seq=48, compile=True, compile_options={"no_such_knob": 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_matmul_attention_equals_the_naive_formula(dtype, head_dim):
    """The decode/verify attention (scale on the queries, bias added in place, softmax in the scores' dtype) gives
    bitwise the values of the plain formula: scores, scale, bias, fp32 softmax, back to the dtype, times v; over the
    first L of M cache slots, with masked slots and rows of several queries."""
    from eyas.target.runner import matmul_attention

    g = torch.Generator().manual_seed(head_dim)
    B, KV, R, M, L = 3, 2, 6, 40, 29
    q = torch.randn(B, KV, R, head_dim, generator=g).to(dtype)
    kc = torch.randn(B, KV, M, head_dim, generator=g).to(dtype)
    vc = torch.randn(B, KV, M, head_dim, generator=g).to(dtype)
    allowed = torch.rand(B, 1, R, L, generator=g) < 0.7
    allowed[..., 0] = True  # every query row sees at least one slot
    bias = torch.zeros(B, 1, R, L, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    scores = torch.matmul(q, kc[:, :, :L].transpose(-1, -2)) * head_dim ** -0.5 + bias
    naive = torch.matmul(torch.softmax(scores.float(), dim=-1).to(dtype), vc[:, :, :L])
    ours = matmul_attention(q, kc, vc, bias.clone())
    assert ours.dtype == dtype and torch.equal(ours, naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lengths_attention_equals_the_matmul_path(dtype):
    """Attention by prefix lengths (flex over a block mask listing only each row's blocks) gives the matmul path's
    values under the equivalent mask: lengths inside the first block, on block edges (128, 256) and the whole cache."""
    from eyas.target.runner import lengths_attention, lengths_block_mask, matmul_attention

    g = torch.Generator().manual_seed(0)
    B, KV, R, M, D = 6, 2, 3, 300, 16
    q = torch.randn(B, KV, R, D, generator=g).to(dtype)
    kc = torch.randn(B, KV, M, D, generator=g).to(dtype)
    vc = torch.randn(B, KV, M, D, generator=g).to(dtype)
    lens = torch.tensor([1, 77, 128, 200, 256, 300])
    outside = torch.arange(M)[None, None, None] >= lens[:, None, None, None]  # (B,1,1,M)
    bias = torch.zeros(B, 1, R, M, dtype=dtype).masked_fill_(outside, float("-inf"))
    mask = lengths_block_mask(lens, R, M)
    assert mask.kv_num_blocks.flatten().tolist() == [1, 1, 0, 1, 0, 1]  # the cut block (none on an edge)
    assert mask.full_kv_num_blocks.flatten().tolist() == [0, 0, 1, 1, 2, 2]
    ours = lengths_attention(q, kc, vc, mask)
    ref = matmul_attention(q, kc, vc, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_generate_by_lengths_equals_the_mask_path():
    """generate(lengths=True), which each step hands the rows' prefix lengths instead of a mask, decodes the mask
    path's greedy tokens through compaction and across a key/value block edge (a 120-token prompt in a 160-slot
    cache); its steps are built by lengths. HFRunner has no such step and says so."""
    from eyas.target.hf_runner import HFRunner

    model = make_tiny_llama(seed=7)
    r = Runner.from_hf(model, max_batch=13, max_seq=160)
    prompts, eos = ragged_case(r)
    prompts = prompts + [torch.randint(3, 256, (120,), generator=torch.Generator().manual_seed(3)).tolist()]
    before = set(r._graphs)
    ours = r.generate(prompts, 36, eos_ids=eos, window=8, lengths=True)
    built = set(r._graphs) - before
    assert {k[4] for k in built} == {True} and any(k[0] < 13 for k in built), built
    assert len(ours[-1]) > 10, "the long prompt must decode past slot 128 for the block edge to be crossed"
    assert ours == r.generate(prompts, 36, eos_ids=eos, window=8, lengths=False)
    with pytest.raises(EyasError, match="by lengths"):
        r.forward(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
                  torch.zeros(1, 2, dtype=torch.long), torch.ones(1, dtype=torch.long))
    with pytest.raises(EyasError, match="needs the Llama runner"):
        HFRunner.from_hf(model, max_batch=1, max_seq=32).generate([[5, 6]], 2, lengths=True)


def test_compiled_runner_refuses_steps_by_lengths():
    """Steps by lengths run eager: inside a compiled step (flex and the block mask in the compiled graph) they gave
    other tokens than the CPU on an H200 and an illegal memory access in regeneration, so a compiled runner says so
    instead of decoding, at the first step, while its mask steps decode as before."""
    model = make_tiny_llama(seed=7)
    prompts, eos = ragged_case(Runner.from_hf(model, max_batch=13, max_seq=160))
    c = Runner.from_hf(model, max_batch=13, max_seq=160, compile=True)
    with pytest.raises(EyasError, match="steps by lengths run eager.*lengths=False"):
        c.generate(prompts, 36, eos_ids=eos, window=8, lengths=True)
    assert not c._graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generate_by_lengths_equals_eager_cpu():
    """On CUDA, generation attends by lengths (by default for an eager batched runner: CUDA graphs around compiled
    flex over a block mask): the CPU's greedy tokens through compaction (a second batch size: flex recompiles
    shape-generic once) and across a block edge; bf16 runs and ends like fp32 in length."""
    model = make_tiny_llama(seed=7)
    cpu = Runner.from_hf(model, max_batch=13, max_seq=160)
    prompts, eos = ragged_case(cpu)
    prompts = prompts + [torch.randint(3, 256, (120,), generator=torch.Generator().manual_seed(3)).tolist()]
    ref = cpu.generate(prompts, 36, eos_ids=eos, window=8, lengths=False)
    gpu = Runner.from_hf(model, max_batch=13, max_seq=160, device="cuda")
    assert gpu.generate(prompts, 36, eos_ids=eos, window=8) == ref
    # the first batch size, then compaction's (on the H200: 13 then 2): flex's second shape is its generic compile
    assert {k[4] for k in gpu._graphs} == {True} and len({k[0] for k in gpu._graphs}) >= 2, list(gpu._graphs)
    half = Runner.from_hf(model, max_batch=13, max_seq=160, device="cuda", dtype=torch.bfloat16)
    out = half.generate(prompts, 36, eos_ids=eos, window=8, lengths=True)
    assert len(out) == len(ref) and all(1 <= len(o) <= 36 for o in out)


def test_fused_layers_decode_the_eager_runner_tokens_on_the_cpu():
    """fuse=True: each layer's norms, projections, RoPE and MLP run as two compiled functions shared by all layers,
    around the eager attention. Prefill logits match the eager runner's, and greedy generation by lengths (the
    attention fused steps are for) gives its tokens through compaction (several batch sizes: the pieces go
    shape-generic) and prefill chunks of several lengths."""
    model = make_tiny_llama(seed=7)
    eager = Runner.from_hf(model, max_batch=12, max_seq=96)
    fused = Runner.from_hf(model, max_batch=12, max_seq=96, fuse=True)
    prompts, eos = ragged_case(eager)
    ids = torch.tensor([prompts[3]])  # 30 tokens in one masked forward
    pos = torch.arange(30)[None]
    mask = torch.ones(1, 30, 30, dtype=torch.bool).tril()
    a, _ = eager(ids, pos, pos, mask)
    b, _ = fused(ids, pos, pos, mask)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    ref = eager.generate(prompts, 48, eos_ids=eos, window=8, lengths=False)
    assert fused.generate(prompts, 48, eos_ids=eos, window=8, lengths=True, prefill_chunk=8) == ref
    assert len({k[0] for k in fused._graphs}) >= 2, list(fused._graphs)  # compaction ran other batch sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_layers_generate_equals_eager_cpu():
    """The fused runner on CUDA (CUDA graphs around the compiled pieces and compiled flex by lengths, generate's
    default there): the CPU's greedy tokens in fp32 through compaction; bf16 runs and ends like fp32 in length."""
    model = make_tiny_llama(seed=7)
    cpu = Runner.from_hf(model, max_batch=13, max_seq=160)
    prompts, eos = ragged_case(cpu)
    prompts = prompts + [torch.randint(3, 256, (120,), generator=torch.Generator().manual_seed(3)).tolist()]
    ref = cpu.generate(prompts, 36, eos_ids=eos, window=8, lengths=False)
    gpu = Runner.from_hf(model, max_batch=13, max_seq=160, device="cuda", fuse=True)
    assert gpu.generate(prompts, 36, eos_ids=eos, window=8) == ref
    assert {k[4] for k in gpu._graphs} == {True} and len({k[0] for k in gpu._graphs}) >= 2, list(gpu._graphs)
    half = Runner.from_hf(model, max_batch=13, max_seq=160, device="cuda", dtype=torch.bfloat16, fuse=True)
    out = half.generate(prompts, 36, eos_ids=eos, window=8)
    assert len(out) == len(ref) and all(1 <= len(o) <= 36 for o in out)


def test_longest_first_prefill_runs_only_the_rows_a_chunk_reaches():
    """prefill of prompts longest first (generate's order) runs each chunk on the rows that reach it; the last-token
    logits equal HF's own forward per prompt, and the aux states over each prompt equal that prompt's batch-1
    prefill, in chunks of 8 (prompts of 2-30 tokens: batches of 12, 9, 6 and 2 rows). Mutation: running the
    chunk on the prefix without cutting its lengths, or writing `final` for all rows, fails here."""
    from eyas.decode.common import prefill

    model = make_tiny_llama(seed=7)
    r = Runner.from_hf(model, max_batch=12, max_seq=64)
    g = torch.Generator().manual_seed(1)
    prompts = sorted((torch.randint(3, 256, (n,), generator=g).tolist()
                      for n in (5, 17, 9, 30, 2, 11, 23, 8, 14, 3, 19, 6)), key=len, reverse=True)
    aux_ids = (1, 2)
    logits, aux = prefill(r, prompts, aux_ids, chunk=8)
    assert aux.shape[:2] == (12, 30)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(logits[b], ref, atol=1e-4, rtol=1e-4)
            one_logits, one_aux = prefill(r, [p], aux_ids, chunk=8)
            torch.testing.assert_close(aux[b, :len(p)], one_aux[0], atol=1e-5, rtol=1e-5)
            assert not aux[b, -(-len(p) // 8) * 8:].any()  # chunks the row does not reach: zeros, not run
