"""Crosscheck flags an engine that returns layer i+1 (the SGLang +1 applied twice) or i-1."""

import torch
from support.models import make_tiny_llama

from eyas.engines.crosscheck import crosscheck, reference_states, report
from eyas.target.layers import sglang_capture_ids, sglang_layer_ids


def test_off_by_one_is_named():
    torch.manual_seed(0)
    model = make_tiny_llama(layers=6)
    n = model.config.num_hidden_layers
    aux = [2, n // 2, n - 3] if n >= 5 else [1, 2, n - 1]
    ids = [torch.randint(0, model.config.vocab_size, (9,)).tolist() for _ in range(2)]
    ref = reference_states(model, ids)
    # final slot = final-norm output = hidden_states[N]; check the reference follows EAGLE3.md section 1
    with torch.inference_mode():
        o = model(input_ids=torch.tensor(ids[0])[None])
        head = model.lm_head(ref[0][:, n])
    assert torch.allclose(head, o.logits[0], atol=1e-5)
    good = [r[:, aux + [n]] for r in ref]
    rows = crosscheck(good, ref, aux, tol=1e-6)
    assert all(r["ok"] for r in rows)
    shifted = [r[:, [a + 1 for a in aux] + [n]] for r in ref]   # engine captured the next layer
    rows = crosscheck(shifted, ref, aux, tol=1e-6)
    assert [r["matches"] for r in rows[:3]] == [a + 1 for a in aux] and rows[3]["ok"]
    lower = [r[:, [a - 1 for a in aux] + [n]] for r in ref]
    assert [r["matches"] for r in crosscheck(lower, ref, aux, tol=1e-6)[:3]] == [a - 1 for a in aux]


def test_a_neighbour_closer_than_the_intended_layer_fails_even_within_tol():
    """A loose --tol that the intended layer meets does not pass a store one layer off: the neighbour it was
    captured from is closer still, so the slot is not ok and the report names that neighbour."""
    torch.manual_seed(0)
    model = make_tiny_llama(layers=6)
    n = model.config.num_hidden_layers
    aux = [1, 2, 4]
    ids = [torch.randint(0, model.config.vocab_size, (9,)).tolist() for _ in range(2)]
    ref = reference_states(model, ids)
    shifted = [r[:, [a + 1 for a in aux] + [n]] for r in ref]
    tol = 2 * max(crosscheck(shifted, ref, aux, tol=0.0)[s]["rel_err"] for s in range(3))
    rows = crosscheck(shifted, ref, aux, tol=tol)
    assert all(r["rel_err"] <= tol for r in rows)  # the intended layers are within tol
    assert [r["ok"] for r in rows] == [False, False, False, True], rows
    assert [r["matches"] for r in rows[:3]] == [a + 1 for a in aux]
    assert [line.endswith(f"OFF BY ONE: matches layer {a + 1}") for line, a in
            zip(report(rows).splitlines()[1:], aux)] == [True] * 3


def test_sglang_ids_round_trip_including_deepseek_quirk():
    for n, arch in [(30, "LlamaForCausalLM"), (61, "DeepseekV3ForCausalLM"), (28, "Qwen3ForCausalLM")]:
        hf = [2, n // 2, n - 3]
        sg = sglang_layer_ids(hf, arch)
        assert sglang_capture_ids(sg, arch) == hf
    assert sglang_layer_ids([2, 15, 27], "LlamaForCausalLM") == [1, 14, 26]
    assert sglang_layer_ids([2, 30, 58], "DeepseekV3ForCausalLM") == [1, 29, 57]
    assert sglang_layer_ids([3, 30, 58], "DeepseekV3ForCausalLM") == [3, 30, 58]   # no +1 unless first is 1
    assert sglang_capture_ids([3, 30, 58], "DeepseekV3ForCausalLM") == [3, 30, 58]
    # the naive "always subtract 1" would be off by one on DeepSeek when the first id is not 2:
    assert sglang_capture_ids([2, 29, 57], "DeepseekV3ForCausalLM") != [3, 30, 58]


def test_bf16_noise_on_massive_activations_is_ok_and_a_neighbour_is_still_caught():
    """Live (SGLang 0.5.14 and vLLM 0.25.0 on SmolLM2, bf16 against the fp32 reference) the deep layers differed
    by up to 86 and 170 in absolute terms, at relative errors of 0.2-1.5%, against 4-99% for the neighbouring
    layers: an absolute bound called every layer a MISMATCH. The relative error tells them apart."""
    torch.manual_seed(0)
    model = make_tiny_llama(layers=6)
    n = model.config.num_hidden_layers
    aux = [2, 3, 4]
    ids = [torch.randint(0, model.config.vocab_size, (12,)).tolist() for _ in range(3)]
    ref = [r.clone() for r in reference_states(model, ids)]
    for r in ref:                                   # a few huge channels, as in real residual streams
        r[:, 1:n, :2] *= 3000.0
    bf16 = [r.to(torch.bfloat16).float() for r in ref]
    engine = [b[:, aux + [n]] for b in bf16]
    # the old absolute bound (0.05) would call this a mismatch
    assert max(float((e - r[:, aux + [n]]).abs().max()) for e, r in zip(engine, ref)) > 0.05
    rows = crosscheck(engine, ref, aux, tol=0.02)
    assert all(r["ok"] for r in rows), rows
    assert all(r["rel_err"] < 0.01 and all(v > r["rel_err"] for v in r["neighbours"].values()) for r in rows)
    shifted = [b[:, [a + 1 for a in aux] + [n]] for b in bf16]
    assert [r["ok"] for r in crosscheck(shifted, ref, aux, tol=0.02)[:3]] == [False] * 3


def test_an_empty_store_is_one_clear_error(tmp_path, capsys):
    from support.engine_fakes import init_store
    from eyas.cli import main
    init_store(tmp_path / "store")
    rc = main(["engine", "crosscheck", "--store", str(tmp_path / "store"), "--target", "unused"])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "holds no samples" in err and str(tmp_path / "store") in err
