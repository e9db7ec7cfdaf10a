"""`eyas engine launch-args` for Kimi-K2.5-shaped targets, and the final norm vLLM's ingest reads from them.

Kimi-K2.5's config.json wraps a DeepSeek-V3 text config (text_config), maps its own config and tokenizer classes
(auto_map, model_type kimi_k25) and claims a 262,144-token context. The server commands must trust its code, take
depth and width from the text config, spell attention DP as each SGLang release wants, bound vLLM's context by
the data, and never turn on batch overlap. Every command runs through `eyas.cli.main`.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from support import engine_src
from support.engine_sglang_layouts import declares_flag, server_arg_sources
from eyas.cli import main
from eyas.engines import launch_args as la
from eyas.engines.final_norm import NORM_KEYS, load_final_norm
from eyas.errors import EyasError

TEXT = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "hidden_size": 7168, "rms_norm_eps": 1e-5, "first_k_dense_replace": 3, "max_position_embeddings": 262144}
KIMI = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}, "text_config": TEXT,
        "vision_config": {"hidden_size": 1152}}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576}


def target(tmp_path, cfg, tokenizer_config=None):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return d / "config.json"


def launch(capsys, cfg_path, engine, *extra, rc=0) -> list[str]:
    assert main(["engine", "launch-args", engine, "--target-config", str(cfg_path), *extra]) == rc
    cap = capsys.readouterr()
    return (cap.out if rc == 0 else cap.err).replace("\\\n", " ").split()


def flag(out, name, k=1):
    i = out.index(name)
    return out[i + 1: i + 1 + k]


# ---- --trust-remote-code ----

@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_kimi_gets_trust_remote_code_and_its_text_config_depth(capsys, tmp_path, engine):
    out = launch(capsys, target(tmp_path, KIMI), engine, "--max-model-len", "4096")
    assert "--trust-remote-code" in out
    if engine == "sglang":               # 61 layers from text_config: (2, 30, 58), the hook on the wrapped LM
        spec = json.loads(flag(out, "--forward-hooks")[0].strip("'"))
        assert spec[0]["config"]["aux_layer_ids"] == [2, 30, 58] and spec[0]["config"]["num_layers"] == 61
        assert spec[0]["target_modules"] == ["language_model.logits_processor"]
    else:
        spec = json.loads(flag(out, "--speculative-config")[0].strip("'"))
        assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58, 61]


@pytest.mark.parametrize("cfg, tok, why", [
    ({**TEXT, "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}, None, "config.json"),
    ({**TEXT, "model_type": "kimi_k2_unknown"}, None, "no model_type 'kimi_k2_unknown'"),
    (TEXT, {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}, "tokenizer_config.json")])
def test_each_reason_for_remote_code_is_seen(tmp_path, cfg, tok, why):
    p = target(tmp_path, cfg, tok)
    reasons = la.read_target_config(p)["remote_code"]
    assert len(reasons) == 1 and why in reasons[0]
    assert "--trust-remote-code" in la.sglang_args(p, "0.5.23")


def test_a_plain_target_is_not_trusted(capsys, tmp_path):
    p = target(tmp_path, LLAMA, {"tokenizer_class": "PreTrainedTokenizerFast"})
    assert "--trust-remote-code" not in launch(capsys, p, "sglang", "--version", "0.5.14")
    assert "--trust-remote-code" not in launch(capsys, p, "vllm", "--max-model-len", "64")


# ---- attention DP ----

@pytest.mark.parametrize("version, want", [
    ("0.5.14", ["--dp-size", "4", "--enable-dp-attention"]), ("0.5.21", ["--dp-size", "4", "--enable-dp-attention"]),
    ("0.5.22", ["--attn-dp-size", "4"]), ("0.5.23", ["--attn-dp-size", "4"])])
def test_attention_dp_spelling_follows_the_release(capsys, tmp_path, version, want):
    out = launch(capsys, target(tmp_path, KIMI), "sglang", "--version", version, "--tp", "8", "--attn-dp", "4")
    dp = [a for a in out if a in ("--dp-size", "--attn-dp-size", "--enable-dp-attention")]
    assert [a for a in out if a in dp or a == "4"] == want


@pytest.mark.slow
@pytest.mark.parametrize("version, has", [("0.5.21", False), ("0.5.22", True), ("0.5.23", True)])
def test_attn_dp_size_arrives_in_0_5_22(version, has):
    """FIRST_ATTN_DP_SIZE_VERSION against the wheels: 0.5.21 lacks the flag, 0.5.22 declares it."""
    whl = engine_src.wheel(version)
    if whl is None:
        pytest.skip(f"sglang {version} wheel not cached and PyPI unreachable")
    assert declares_flag(server_arg_sources(whl), "--attn-dp-size") is has
    assert (la.parse_version(version) >= la.FIRST_ATTN_DP_SIZE_VERSION) is has


# ---- vLLM --max-model-len ----

def test_vllm_context_is_the_longest_prepared_sample_plus_one(capsys, tmp_path):
    from test_engine_vllm import write_prepared
    prep = write_prepared(tmp_path / "prep", {"x": list(range(5, 17)), "y": list(range(40, 70)), "z": [1, 2, 3]})
    out = launch(capsys, target(tmp_path, KIMI), "vllm", "--data", str(prep))
    assert flag(out, "--max-model-len") == ["31"]
    assert flag(launch(capsys, target(tmp_path, KIMI), "vllm", "--data", str(prep), "--max-model-len", "8192"),
                "--max-model-len") == ["8192"]


def test_vllm_without_data_or_max_model_len_is_refused_not_given_262k(capsys, tmp_path):
    err = " ".join(launch(capsys, target(tmp_path, KIMI), "vllm", rc=2))
    assert "--max-model-len" in err and "262144" not in err


# ---- batch overlap ----

@pytest.mark.parametrize("version", ["0.5.14", "0.5.22", "0.5.23"])
def test_launch_args_never_turn_on_batch_overlap(capsys, tmp_path, version):
    out = launch(capsys, target(tmp_path, KIMI), "sglang", "--version", version, "--tp", "8", "--attn-dp", "8")
    out += launch(capsys, target(tmp_path, KIMI), "vllm", "--tp", "8", "--max-model-len", "4096")
    assert not [a for a in out if "overlap" in a or "dbo" in a]


# ---- the final norm vLLM's last slot lacks ----

def sharded(d, names: dict, cfg=None):
    """A checkpoint behind a safetensors index: {tensor name: (shard file, tensor)}."""
    d.mkdir(parents=True, exist_ok=True)
    shards: dict = {}
    for name, (f, t) in names.items():
        shards.setdefault(f, {})[name] = t
    for f, tensors in shards.items():
        save_file(tensors, str(d / f))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: f for n, (f, _) in names.items()}}))
    (d / "config.json").write_text(json.dumps(cfg or {**KIMI, "text_config": {**TEXT, "hidden_size": 8}}))
    return d / "config.json"


@pytest.mark.parametrize("name", NORM_KEYS)
def test_final_norm_under_each_known_name(tmp_path, name):
    """NVIDIA's Kimi-K2.5 checkpoints name it language_model.norm.weight (their layers: language_model.layers.*)."""
    w = torch.rand(8) + 0.5
    p = sharded(tmp_path / "t", {name: ("model-00009.safetensors", w),
                                 "language_model.layers.0.input_layernorm.weight": ("model-00001.safetensors", w * 0),
                                 "vision_tower.norm.weight": ("model-00001.safetensors", w * 0)})
    norm = load_final_norm(p)
    assert torch.equal(norm.weight, w) and norm.eps == 1e-5


def test_absent_final_norm_names_the_index_and_every_name_tried(tmp_path):
    w = torch.ones(8)
    p = sharded(tmp_path / "t", {"language_model.layers.0.input_layernorm.weight": ("model-00001.safetensors", w)})
    with pytest.raises(EyasError) as e:
        load_final_norm(p)
    msg = str(e.value)
    assert "\n" not in msg and "model.safetensors.index.json" in msg and all(k in msg for k in NORM_KEYS)


def test_a_norm_whose_shard_is_missing_names_the_shard(tmp_path):
    p = sharded(tmp_path / "t", {"language_model.norm.weight": ("model-00064-of-00064.safetensors", torch.ones(8))})
    (p.parent / "model-00064-of-00064.safetensors").unlink()
    with pytest.raises(EyasError, match=r"model-00064-of-00064\.safetensors: absent, but .* language_model\.norm"):
        load_final_norm(p)


def test_the_norm_is_read_alone_not_every_shard(tmp_path, monkeypatch):
    """Only the norm's shard is opened (a 600 GB checkpoint must not be read whole)."""
    import safetensors
    w = torch.rand(8) + 0.5
    p = sharded(tmp_path / "t", {"language_model.norm.weight": ("model-00002.safetensors", w),
                                 "language_model.layers.0.mlp.weight": ("model-00001.safetensors", torch.ones(4, 4))})
    opened = []
    real = safetensors.safe_open

    def spy(path, *a, **k):
        opened.append(path)
        return real(path, *a, **k)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    assert torch.equal(load_final_norm(p).weight, w)
    assert [str(x).rsplit("/", 1)[-1] for x in opened] == ["model-00002.safetensors"]
