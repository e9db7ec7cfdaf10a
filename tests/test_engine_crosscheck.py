"""Crosscheck flags an engine that returns layer i+1 (the SGLang +1 applied twice) or i-1."""

import torch
from conftest import make_tiny_llama

from eyas.engines.crosscheck import crosscheck, reference_states
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
