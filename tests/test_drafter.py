"""The drafter: export keys, a written-out reference forward, KV-cache consistency, RoPE, checkpoints."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.model.checkpoint import load_drafter, save_drafter
from eyas.model.drafter import DrafterConfig, Eagle3Drafter, rope_inv_freq
from eyas.model.vocab import build_draft_vocab

# EAGLE3.md section 5, written out independently of the model code: key -> shape for h=64, h_t=64, 4 heads of 16,
# 2 kv heads, intermediate 128, V=256, draft vocab 100.
EXPORT_KEYS = {
    "fc.weight": (64, 192),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.self_attn.q_proj.weight": (64, 128),
    "midlayer.self_attn.k_proj.weight": (32, 128),
    "midlayer.self_attn.v_proj.weight": (32, 128),
    "midlayer.self_attn.o_proj.weight": (64, 64),
    "midlayer.post_attention_layernorm.weight": (64,),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "norm.weight": (64,),
    "lm_head.weight": (100, 64),
    "d2t": (100,),
    "t2d": (256,),
}


def initialised_drafter(seed=0, std=0.2, **target_kw):
    target = make_tiny_llama(**target_kw)
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=100, aux_layer_ids=(2, 2, 1))
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    d.init_weights(std=std)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return d


def test_state_dict_keys_are_the_export_keys():
    d = initialised_drafter()
    sd = d.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == EXPORT_KEYS
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert not any("embed" in k for k in sd)


def test_config_from_target():
    target = make_tiny_llama(hidden=96, heads=6, kv_heads=2, inter=200, rope_theta=500000.0, max_pos=300, tie=True)
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=10**6, aux_layer_ids=[2, 2, 1])
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size) == (96, 96, 6, 2, 16, 200)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 300 and cfg.rms_norm_eps == 1e-5
    assert cfg.vocab_size == 256 and cfg.draft_vocab_size == 256          # capped at the target vocab
    assert cfg.aux_layer_ids == (2, 2, 1)
    small = DrafterConfig.from_target(target.config, draft_vocab_size=64, aux_layer_ids=(2, 2, 1), intermediate_size=32)
    assert small.intermediate_size == 32 and small.draft_vocab_size == 64
    assert DrafterConfig.from_dict(json.loads(json.dumps(small.to_dict()))) == small
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DrafterConfig.from_dict({**small.to_dict(), "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="unknown keys"):
        DrafterConfig.from_dict({**small.to_dict(), "bogus": 1})


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_matches_hf_llama(scaling):
    """The drafter's RoPE (taken from the target config) equals HF's LlamaRotaryEmbedding for that config."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256,
              max_position_embeddings=512, rope_theta=50000.0)
    if scaling:
        kw["rope_scaling"] = dict(scaling)
    hf = LlamaConfig(**kw)
    cfg = DrafterConfig.from_target(hf, draft_vocab_size=100, aux_layer_ids=(2, 2, 1))
    assert cfg.rope_theta == 50000.0
    assert (cfg.rope_scaling or {}).get("rope_type", "default") == (scaling or {}).get("rope_type", "default")
    d = Eagle3Drafter(cfg)
    pos = torch.arange(0, 400, 7)[None]
    cos, sin = d.rope(pos, torch.float32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, 1, dtype=torch.float32), pos)
    torch.testing.assert_close(cos, hf_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- naive reference forward
def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def naive_layer(d, hidden, embeds, pos, mask, *, embed_first=True, residual_normed=False):
    """Written out from EAGLE3.md section 2 with explicit GQA head mapping; reads d's weights only."""
    c, L = d.config, d.midlayer
    B, S, h = hidden.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    e, g = rms(embeds, L.input_layernorm.weight), rms(hidden, L.hidden_norm.weight)
    x = torch.cat([e, g] if embed_first else [g, e], dim=-1)
    q = (x @ L.self_attn.q_proj.weight.T).view(B, S, nh, hd)
    k = (x @ L.self_attn.k_proj.weight.T).view(B, S, nkv, hd)
    v = (x @ L.self_attn.v_proj.weight.T).view(B, S, nkv, hd)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = (pos[..., None].double() * inv).float()                         # (B, S, hd/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, :, None], torch.cat([ang.sin()] * 2, -1)[:, :, None]

    def rot(t):
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    q, k = rot(q), rot(k)
    out = torch.zeros(B, S, nh * hd)
    for b in range(B):
        for i in range(S):
            for hh in range(nh):
                kv = hh // (nh // nkv)
                s = torch.tensor([float(q[b, i, hh] @ k[b, j, kv]) for j in range(S)]) / math.sqrt(hd)
                s = s.masked_fill(~mask[b, i], float("-inf"))
                out[b, i, hh * hd:(hh + 1) * hd] = torch.softmax(s, 0) @ v[b, :, kv]
    res = g if residual_normed else hidden
    h1 = res + out @ L.self_attn.o_proj.weight.T
    z = rms(h1, L.post_attention_layernorm.weight)
    m = L.mlp
    return h1 + (F.silu(z @ m.gate_proj.weight.T) * (z @ m.up_proj.weight.T)) @ m.down_proj.weight.T


def test_layer_matches_naive_reference_and_order_and_residual_matter():
    d = initialised_drafter()
    torch.manual_seed(1)
    B, S = 2, 6
    hidden, embeds = torch.randn(B, S, 64) * 2, torch.randn(B, S, 64)
    pos = torch.arange(S).expand(B, S) + torch.tensor([[0], [5]])
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool)).expand(B, S, S)
    with torch.no_grad():
        out, (k, v) = d.layer(hidden, embeds, pos, mask)
        ref = naive_layer(d, hidden, embeds, pos, mask)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert k.shape == v.shape == (B, 2, S, 16)
        assert (out - naive_layer(d, hidden, embeds, pos, mask, embed_first=False)).abs().max() > 1e-2
        assert (out - naive_layer(d, hidden, embeds, pos, mask, residual_normed=True)).abs().max() > 1e-2
        # RoPE is relative: a uniform shift is invisible, a non-uniform one is not.
        torch.testing.assert_close(naive_layer(d, hidden, embeds, pos + 3, mask), ref, rtol=1e-4, atol=1e-4)
        bumped = pos.clone()
        bumped[:, 0] -= 1
        assert (out - naive_layer(d, hidden, embeds, bumped, mask)).abs().max() > 1e-3
        torch.testing.assert_close(d.logits(out), rms(out, d.norm.weight) @ d.lm_head.weight.T)
        torch.testing.assert_close(d.fuse(torch.ones(B, S, 192)), torch.ones(B, S, 192) @ d.fc.weight.T)


def test_decode_attention_equals_the_training_path(monkeypatch):
    """Decoding (no grad, few query rows) attends with grouped matmuls, without repeating k/v; training and long
    prefills use SDPA on repeated k/v. Both match the naive reference, with a cache and a tree-shaped mask."""
    from eyas.model import drafter as drafter_mod

    d = initialised_drafter(seed=3)
    torch.manual_seed(4)
    B, P, S = 2, 7, 5
    hidden, embeds = torch.randn(B, P + S, 64), torch.randn(B, P + S, 64)
    pos = torch.arange(P + S).expand(B, P + S)
    mask = torch.tril(torch.ones(P + S, P + S, dtype=torch.bool)).repeat(B, 1, 1)
    mask[0, P + 3, P + 1] = False                                        # a side branch: node 3 does not see node 1
    mask[1, P + 4, :P - 2] = False                                       # a row that skips part of the prefix
    ref = naive_layer(d, hidden, embeds, pos, mask)
    with torch.no_grad():
        _, cache = d.layer(hidden[:, :P], embeds[:, :P], pos[:, :P], mask[:, :P, :P])
        step = (hidden[:, P:], embeds[:, P:], pos[:, P:], mask[:, P:], cache)
        grouped, (k, v) = d.layer(*step)
        monkeypatch.setattr(drafter_mod, "GROUPED_ROWS", 0)                # the SDPA path
        sdpa, (k2, v2) = d.layer(*step)
    trained, _ = d.layer(*step)                                           # grad on: the training path
    for out in (grouped, sdpa, trained):
        torch.testing.assert_close(out, ref[:, P:], rtol=1e-5, atol=1e-5)
    assert torch.equal(k, k2) and torch.equal(v, v2) and k.shape == (B, 2, P + S, 16)
    # under autocast (the trainer's bf16 evaluation) the fp32 score matmul would run in bf16: SDPA instead
    monkeypatch.setattr(drafter_mod, "GROUPED_ROWS", 256)
    monkeypatch.setattr(drafter_mod, "grouped_attend", lambda *a: pytest.fail("grouped attention under autocast"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        d.layer(*step)


def test_kv_cached_steps_equal_one_full_call():
    d = initialised_drafter()
    torch.manual_seed(2)
    B, S = 2, 9
    hidden, embeds = torch.randn(B, S, 64), torch.randn(B, S, 64)
    pos = torch.arange(S).expand(B, S)
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool)).expand(B, S, S)
    with torch.no_grad():
        full, (kf, vf) = d.layer(hidden, embeds, pos, causal)
        cache, outs = None, []
        for a, b in [(0, 3), (3, 4), (4, 7), (7, 9)]:               # prefill, then 1-token and multi-token steps
            o, cache = d.layer(hidden[:, a:b], embeds[:, a:b], pos[:, a:b], causal[:, a:b, :b], cache)
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[0], kf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[1], vf, rtol=1e-5, atol=1e-5)


def test_vocab_maps_and_draft_to_target():
    d = initialised_drafter()
    counts = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(0))
    vocab = build_draft_vocab(counts, 100)
    d.set_vocab(vocab.d2t, vocab.t2d)
    draft_ids = torch.tensor([[0, 5, 99]])
    assert d.draft_to_target(draft_ids).tolist() == [[int(vocab.token_ids[i]) for i in (0, 5, 99)]]
    assert torch.equal(d.token_ids, vocab.token_ids)
    with pytest.raises(ValueError, match="shapes"):
        d.set_vocab(vocab.d2t[:50], vocab.t2d)


def test_save_load_round_trip(tmp_path):
    d = initialised_drafter()
    vocab = build_draft_vocab(torch.arange(256), 100)
    d.set_vocab(vocab.d2t, vocab.t2d)
    meta = {"target": {"identity": "tiny", "config_sha256": "ab", "tokenizer_sha256": "cd"}}
    save_drafter(d, tmp_path / "drafter", meta)
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["target"] == meta["target"] and raw["rope_theta"] == d.config.rope_theta
    d2, meta2 = load_drafter(tmp_path / "drafter")
    assert meta2 == meta and d2.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(v, d2.state_dict()[k]), k
    torch.testing.assert_close(d2.inv_freq, rope_inv_freq(d.config))


def test_load_refuses_bad_checkpoints(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(EyasError, match="missing"):
        load_drafter(tmp_path / "nothing")
    d = initialised_drafter()
    save_drafter(d, tmp_path / "a", {})
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(256, 64)
    save_file(state, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(EyasError, match="unexpected.*embed_tokens"):
        load_drafter(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    with pytest.raises(EyasError, match="bad drafter config"):
        load_drafter(tmp_path / "a")
