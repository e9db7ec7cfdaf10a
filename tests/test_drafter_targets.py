"""The drafter shape derived from real targets: DeepSeek-V3, Kimi-K2, Kimi-K2.5 (a VLM wrapper) get the Llama head of
the published EAGLE-3 heads (no YaRN refusal, plain RoPE at the stated theta), Llama-like targets keep their own
shape and RoPE, a yarn-scaled Llama-like target trains plain RoPE, and config.json says exactly what was trained."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from support.models import make_tiny_llama
from support.deepseek_twin import make_twin
from eyas.model.drafter import MLA_ROPE_THETA, DrafterConfig, Eagle3Drafter

# Public config.json fields of the targets (the fields a drafter derivation can read; quantization and routing
# details left out). DeepSeek-V3 (671B): huggingface.co/deepseek-ai/DeepSeek-V3 config.json.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
# Kimi-K2-Instruct: huggingface.co/moonshotai/Kimi-K2-Instruct config.json.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
}
# Kimi-K2.5: huggingface.co/moonshotai/Kimi-K2.5 config.json, a KimiK25ForConditionalGeneration wrapper whose
# language model sits under text_config (and MoonViT under vision_config).
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "bos_token_id": 163584,
    "eos_token_id": 163585, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "text_config": {**KIMI_K2, "max_position_embeddings": 262144, "rms_norm_eps": 1e-05,
                    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                     "type": "yarn"}},
    "vision_config": {"patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
                      "merge_kernel_size": [2, 2], "mm_hidden_size": 1152, "mm_projector_type": "patchmerger",
                      "text_hidden_size": 7168, "vt_hidden_size": 1152, "vt_intermediate_size": 4304,
                      "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27},
}
# The published Kimi EAGLE-3 heads (SpecForge configs/kimi-k2-eagle3.json and configs/kimi-k25-eagle3.json,
# huggingface.co/AQ-MedAI/Kimi-K2-Instruct-eagle3 config.json): one Llama layer of these sizes, no rope scaling.
PUBLISHED_KIMI_HEAD = {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
                       "intermediate_size": 18432, "vocab_size": 163840, "draft_vocab_size": 32000,
                       "rope_scaling": None, "rope_theta": 1000000.0}


def view(d):
    """An attribute view of config.json as a weightless target reads it (no remote code): nested dicts stay dicts."""
    return SimpleNamespace(**d)


def to_v5(text: dict) -> dict:
    """The transformers-5 spelling of a text config: theta and scaling inside rope_parameters."""
    out = {k: v for k, v in text.items() if k not in ("rope_theta", "rope_scaling")}
    s = dict(text["rope_scaling"])
    out["rope_parameters"] = {"rope_type": s.pop("type"), **s, "rope_theta": float(text["rope_theta"])}
    return out


def kimi_head_params(vocab_out=32000) -> int:
    """Eagle3Drafter parameters at h 7168, 64 x 128 heads (64 kv), mlp 18432, written out per tensor."""
    h, a = 7168, 64 * 128
    fc, q, k, v, o = 3 * h * h, 2 * h * a, 2 * h * a, 2 * h * a, a * h
    mlp, norms, head = 3 * h * 18432, 4 * h, vocab_out * h
    return fc + q + k + v + o + mlp + norms + head


def kimi_like_text_configs():
    """(name, config object) for every published target in each spelling a caller may hand over."""
    from transformers import DeepseekV3Config, LlavaConfig

    k25_text = KIMI_K25["text_config"]
    return [
        ("deepseek-v3 json", view(DEEPSEEK_V3)),
        ("deepseek-v3 transformers", DeepseekV3Config(**DEEPSEEK_V3)),
        ("kimi-k2 json", view(KIMI_K2)),
        ("kimi-k2 transformers", DeepseekV3Config(**KIMI_K2)),
        ("kimi-k2.5 json (v4 spelling)", view(KIMI_K25)),
        ("kimi-k2.5 json (v5 spelling)", view({**KIMI_K25, "text_config": to_v5(k25_text)})),
        ("kimi-k2.5 dict", KIMI_K25),
        ("kimi-k2.5 transformers wrapper", LlavaConfig(text_config=DeepseekV3Config(**k25_text))),
    ]


@pytest.mark.parametrize("name,config", kimi_like_text_configs(), ids=lambda x: x if isinstance(x, str) else "")
def test_published_targets_get_the_published_kimi_head(name, config):
    """No yarn refusal; the shape of the published Kimi heads; plain RoPE at the stated theta; the target's eps,
    vocabulary and context length; parameter count = the per-tensor sum (1.19B)."""
    cfg = DrafterConfig.from_target(config, draft_vocab_size=32000, aux_layer_ids=(2, 30, 58))
    src = DEEPSEEK_V3 if name.startswith("deepseek") else KIMI_K2 if name.startswith("kimi-k2 ") else \
        KIMI_K25["text_config"]
    got = {k: getattr(cfg, k) for k in PUBLISHED_KIMI_HEAD}
    assert got == {**PUBLISHED_KIMI_HEAD, "vocab_size": src["vocab_size"]}
    assert cfg.target_hidden_size == 7168 and cfg.rope_theta == MLA_ROPE_THETA
    assert cfg.max_position_embeddings == src["max_position_embeddings"]       # >= the target's context
    assert cfg.rms_norm_eps == src["rms_norm_eps"]
    assert cfg.param_count() == kimi_head_params() == 1_190_948_864
    assert cfg.summary() == (f"h 7168, 64 x 128 heads (64 kv), mlp 18432, vocab {src['vocab_size']} -> 32000, "
                             f"rope theta 1000000 (no scaling), 1.19B params")


def test_param_count_is_the_models_at_the_kimi_shape():
    """param_count() counts what Eagle3Drafter builds (on the meta device: no 4.8 GB allocation)."""
    cfg = DrafterConfig.from_target(view(KIMI_K25), draft_vocab_size=32000, aux_layer_ids=(2, 30, 58))
    with torch.device("meta"):
        d = Eagle3Drafter(cfg)
    assert sum(p.numel() for p in d.parameters()) == cfg.param_count()
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert shapes["midlayer.self_attn.q_proj.weight"] == (8192, 14336)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (8192, 14336)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (7168, 8192)
    assert shapes["lm_head.weight"] == (32000, 7168) and shapes["t2d"] == (163840,)


def test_twin_gets_the_mla_head_without_yarn_refusal():
    """The tiny DeepSeek-V3 twin (YaRN, MLA, MoE) used to raise "rope_type 'yarn' is not supported"."""
    model, _ = make_twin()
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=100, aux_layer_ids=(2, 3, 4))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size) == (64, 4, 4, 128, 128)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) == (MLA_ROPE_THETA, None, 2048)
    d = Eagle3Drafter(cfg)
    assert sum(p.numel() for p in d.parameters()) == cfg.param_count()


def test_llama_derivation_is_unchanged():
    """Llama-like targets keep exactly today's derivation (SmolLM2-135M's shape and a llama3-scaled Llama)."""
    from transformers import LlamaConfig

    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    cfg = DrafterConfig.from_target(smol, draft_vocab_size=32000, aux_layer_ids=(2, 15, 27))
    assert cfg == DrafterConfig(hidden_size=576, target_hidden_size=576, intermediate_size=1536,
                                num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
                                vocab_size=49152, draft_vocab_size=32000, aux_layer_ids=(2, 15, 27))
    assert cfg.summary() == ("h 576, 9 x 64 heads (3 kv), mlp 1536, vocab 49152 -> 32000, rope theta 100000 "
                             "(no scaling), 23.5M params")
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    l31 = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=dict(llama3))
    c = DrafterConfig.from_target(l31, draft_vocab_size=500, aux_layer_ids=(2, 2, 1))
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_theta) == (8, 2, 32, 500000.0)
    assert {k: v for k, v in c.rope_scaling.items() if k != "type"} == llama3
    tiny = make_tiny_llama()
    t = DrafterConfig.from_target(tiny.config, draft_vocab_size=100, aux_layer_ids=(1, 2, 3))
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.rope_theta) == (4, 2, 16, 10000.0)


def _rope_from_config_json(config: dict, pos):
    """The RoPE an engine builds from the exported config.json (HF's LlamaRotaryEmbedding of that config)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size")
    hf = LlamaConfig(**{k: config[k] for k in keys})
    return LlamaRotaryEmbedding(hf)(torch.zeros(1, 1), pos)


def naive_rope(theta, hd, pos):
    """cos/sin written out from the RoFormer definition in float64: angle = p * theta^(-2i/hd), halves repeated."""
    i = torch.arange(hd // 2, dtype=torch.float64)
    ang = pos.double()[..., None] * theta ** (-2 * i / hd)
    return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)


def test_yarn_on_a_llama_like_target_trains_and_exports_plain_rope(tmp_path):
    """A Qwen3 target with yarn scaling (both spellings) is not refused: its own shape and theta, plain RoPE, and
    config.json says rope_scaling null, so the engines rebuild the drafter's RoPE exactly."""
    from transformers import Qwen3Config

    from eyas.export.export import export_drafter

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    raw = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "vocab_size": 300, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0}
    for target in (Qwen3Config(**raw, rope_scaling=dict(yarn)),
                   view({**raw, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32768}})):
        cfg = DrafterConfig.from_target(target, draft_vocab_size=300, aux_layer_ids=(1, 2, 3))
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
        assert (cfg.rope_theta, cfg.rope_scaling) == (1000000.0, None)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    config = json.loads((export_drafter(d, tmp_path / "exp") / "config.json").read_text())
    assert config["rope_theta"] == 1000000.0 and config["rope_scaling"] is None
    pos = torch.arange(0, 8192, 37)[None]
    cos, sin = d.rope(pos, torch.float32)
    hf_cos, hf_sin = _rope_from_config_json(config, pos)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=5e-4)    # fp32 angles of up to 8k rad (ulp 5e-4)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=5e-4)


def _samples(n=24, vocab=320, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(12, 40, (1,), generator=g))
        out.append((f"s{i}", torch.randint(3, vocab, (L,), generator=g).tolist(), [0] * (L // 3) + [1] * (L - L // 3)))
    return out


def test_training_on_the_twin_uses_and_exports_the_stated_rope(tmp_path, capfd):
    """End to end on the DeepSeek-V3 twin: capture, a few train steps (the loss falls), the announced shape, and a
    drafter whose RoPE equals a naive RoFormer reference at theta 1e6 and the RoPE an engine builds from its
    exported config.json (rope_theta 1e6, rope_scaling null, head_dim 128)."""
    from eyas.capture.capture import CaptureConfig, run_capture
    from eyas.export.export import export_drafter
    from eyas.model.checkpoint import load_drafter
    from eyas.target import target_from_model
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import run_train

    model, _ = make_twin()
    target = target_from_model(model, name="twin")
    run_capture(CaptureConfig(out=str(tmp_path / "store"), progress=False), target, samples=_samples(n=12))
    run = tmp_path / "run"
    run_train(TrainConfig(out=str(run), store=str(tmp_path / "store"), steps=8, batch_tokens=128, draft_vocab=128,
                          ttt_steps=2, eval_fraction=0.0, progress=False, deterministic=True, lr=3e-3),
              target=target)
    err = capfd.readouterr().err
    assert ("eyas train: drafter: h 64, 4 x 128 heads (4 kv), mlp 128, vocab 320 -> 128, rope theta 1000000 "
            "(no scaling), 274.7K params") in err
    losses = [json.loads(x)["loss"] for x in open(run / "metrics.jsonl") if json.loads(x)["split"] == "train"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]

    d, _ = load_drafter(run / "drafter")
    expect = DrafterConfig.from_target(model.config, draft_vocab_size=128, aux_layer_ids=target.aux_layer_ids)
    assert d.config == expect and d.config.head_dim == 128 and d.config.rope_theta == 1e6
    pos = torch.arange(0, 4096, 13)[None]
    cos, sin = d.rope(pos, torch.float32)
    ref_cos, ref_sin = naive_rope(1e6, 128, pos)
    # fp32 angles (up to 4k rad, ulp 2.4e-4) against float64
    torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=5e-4)
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=5e-4)
    # theta matters at this tolerance: the target's 50000 would differ by far more
    assert (naive_rope(5e4, 128, pos)[0] - ref_cos).abs().max() > 0.1
    config = json.loads((export_drafter(d, tmp_path / "exp") / "config.json").read_text())
    assert (config["rope_theta"], config["rope_scaling"], config["head_dim"]) == (1e6, None, 128)
    hf_cos, hf_sin = _rope_from_config_json(config, pos)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=5e-4)    # fp32 angles of up to 8k rad (ulp 5e-4)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=5e-4)
