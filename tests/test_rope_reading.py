"""One reading of a target's RoPE (target/fingerprint.py rope_of) serves the fingerprint and the drafter's shape, and
changes neither: over every config the tests build (tiny Llamas, the DeepSeek-V3 and Kimi-K2.5 twins as transformers
and as config.json read them, Kimi-K2's public fields, YaRN / linear / llama3 / dynamic spellings of transformers 4
and 5), `_rope` and `target_rope` give exactly what the two separate parsers before it gave (copied below)."""

import json
from types import SimpleNamespace

import pytest

from support.models import make_tiny_llama
from eyas.model.shape import target_rope
from eyas.target.fingerprint import _number, _rope, config_fields, rope_of
from eyas.target.meta import JsonConfig


def old_fingerprint_rope(cfg) -> dict:
    """target/fingerprint.py `_rope` before rope_of, verbatim."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None)
    kind = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    out = {"rope_theta": _number(float(theta)) if theta is not None else None}
    if kind != "default":
        out["rope_scaling"] = {"rope_type": kind, **{k: _number(v) for k, v in sorted(params.items())}}
    return out


def old_target_rope(c) -> tuple[float, dict | None]:
    """model/shape.py `target_rope` before rope_of, verbatim."""
    if isinstance(c, dict):
        c = SimpleNamespace(**c)
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = float(rope.pop("rope_theta", None) or getattr(c, "rope_theta", None) or 10000.0)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return theta, (rope if rope.get("rope_type", "default") != "default" else None)


KIMI_K2 = {  # moonshotai/Kimi-K2-Instruct's public config.json fields (as tests/test_weightless.py writes them)
    "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "intermediate_size": 18432,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}
YARN = {"factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0}
JSON_SPELLINGS = {   # config.json dicts: transformers 4's and 5's spellings, both keys, none, a published head's
    "none": {},
    "theta only": {"rope_theta": 500000.0},
    "head, null scaling": {"rope_theta": 1e6, "rope_scaling": None},
    "4.x yarn": {"rope_theta": 50000.0, "rope_scaling": {"type": "yarn", **YARN}},
    "4.x yarn, both keys": {"rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "rope_type": "yarn", **YARN}},
    "5.x yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, **YARN}},
    "5.x yarn, both keys": {"rope_parameters": {"rope_type": "yarn", "type": "yarn", "rope_theta": 5e4, **YARN}},
    "5.x default": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "4.x linear": {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "4.x dynamic": {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}},
    "Kimi-K2": KIMI_K2,
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """name -> a config as the stages see it: transformers objects, JsonConfig views and dicts of config.json."""
    from support.deepseek_twin import save_twin, twin_config
    from support.kimi_twin import wrap_twin
    from transformers import AutoConfig, DeepseekV3Config, LlamaConfig

    from eyas.target.meta import open_target_meta

    out = {f"json {k}": v for k, v in JSON_SPELLINGS.items()}
    out |= {f"view {k}": JsonConfig(v) for k, v in JSON_SPELLINGS.items()}
    for k, v in JSON_SPELLINGS.items():
        if k != "Kimi-K2":
            out[f"LlamaConfig {k}"] = LlamaConfig.from_dict({"model_type": "llama", **v})
    out["DeepseekV3Config Kimi-K2"] = DeepseekV3Config.from_dict({**KIMI_K2, "model_type": "deepseek_v3"})
    out["tiny llama"] = make_tiny_llama().config
    out["tiny llama theta 5e5"] = make_tiny_llama(rope_theta=5e5).config
    out["deepseek twin"] = twin_config()
    root = tmp_path_factory.mktemp("rope")
    twin = save_twin(root / "twin", layers=3)
    kimi = wrap_twin(twin, root / "kimi")
    out["deepseek twin config.json"] = json.loads((twin / "config.json").read_text())
    out["deepseek twin AutoConfig"] = AutoConfig.from_pretrained(str(twin))
    out["deepseek twin open_target_meta"] = open_target_meta(str(twin), tensors=()).config
    out["kimi twin text_config json"] = json.loads((kimi / "config.json").read_text())["text_config"]
    out["kimi twin open_target_meta"] = open_target_meta(str(kimi), tensors=()).config
    return out


def test_fingerprint_and_shape_read_every_config_as_before(configs):
    assert len(configs) >= 40
    for name, c in configs.items():
        view = SimpleNamespace(**c) if isinstance(c, dict) else c   # the fingerprint reads attributes
        assert _rope(view) == old_fingerprint_rope(view), name
        assert target_rope(c) == old_target_rope(c), name
        if not isinstance(c, dict):
            assert {k: v for k, v in config_fields(c).items() if k.startswith("rope_")} == old_fingerprint_rope(
                c.get_text_config() if hasattr(c, "get_text_config") else c), name


def test_both_read_one_parse(configs):
    """The kind and theta the drafter shape takes are the fingerprint's (theta 10000 where the config has none)."""
    for name, c in configs.items():
        view = SimpleNamespace(**c) if isinstance(c, dict) else c
        theta, params = rope_of(c)
        fp, (shape_theta, scaling) = _rope(view), target_rope(c)
        assert fp["rope_theta"] == (None if theta is None else _number(float(theta))), name
        assert shape_theta == float(theta or 10000.0), name
        assert (scaling or {}).get("rope_type", "default") == fp.get("rope_scaling", {}).get("rope_type", "default") \
            == params["rope_type"], name
