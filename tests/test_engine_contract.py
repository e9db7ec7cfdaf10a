"""Our export vs the real SGLang / vLLM EAGLE-3 loaders (pinned in eyas.export.engine_pins).

The loaders are parsed, not imported (they need CUDA): tests/support/engine_contract.py instantiates
their model classes abstractly with our config.json, and the tests replay their load_weights
name mapping (its literals read from the source) over our model.safetensors. Every engine
parameter must be filled from our file with the right shape (embed_tokens excepted: the target's),
every tensor we write must land somewhere (or be a deliberate skip), and every config field the
EAGLE-3 code reads must be one we write or one whose absence we have reviewed.
"""

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import engine_wheels
from support.models import make_tiny_llama
from support.engine_contract import (NS, Interpreter, Module, ParamSpec, assigned_literal, config_fields_read,
                             dict_keys_read, find_function, flatten, replace_calls, substring_branches)
from eyas.export.export import export_drafter
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.target import target_from_model

# Config fields the EAGLE-3 code reads that we deliberately do NOT write (absent = the default we want).
REVIEWED_ABSENT = {
    "target_hidden_size",      # written only when it differs from hidden_size (the default both engines use)
    "num_aux_hidden_states",   # default: len(eagle_config ids) = 3
    "norm_before_fc",          # written (true) only for a drafter trained with it: the norm-before-fc export below
    "fc_norm", "use_aux_norm", "norm_output", "norm_before_residual",  # variants we don't train
    "bias", "logit_scale", "target_layer_count", "rope_parameters", "intermediate_size_mlp",
    "original_max_position_embeddings", "rope_is_neox_style", "partial_rotary_factor", "layer_types",
    "sliding_window", "mlp_bias", "qkv_bias", "is_causal",
}
# Plain Llama fields the engines' Llama code reads; they must be written (checked below).
LLAMA_FIELDS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size",
                "hidden_act", "tie_word_embeddings", "num_hidden_layers", "model_type", "attention_bias"}
TARGET_LAYERS, VOCAB, DRAFT_VOCAB = 8, 256, 100


def _source(engine):
    try:
        root = engine_wheels.engine_source(engine)
    except engine_wheels.NoNetwork as e:
        pytest.skip(f"no network: {e}")
    return {f[:-3].replace("/", "."): Module(root / f, f[:-3].replace("/", ".")) for f in engine_wheels.FILES[engine]}


@pytest.fixture(scope="module")
def sglang():
    return _source("sglang")


@pytest.fixture(scope="module")
def vllm():
    return _source("vllm")


@pytest.fixture(scope="module", params=[DRAFT_VOCAB, VOCAB, "smollm2", "norm-before-fc"],
                ids=["draft-vocab", "full-vocab", "smollm2-shaped", "norm-before-fc"])
def exported(request, tmp_path_factory):
    if request.param == "smollm2":
        # A real export (EYAS_CHECK_EXPORT=runs/cpu-demo/export), or one with the embedded default's exact
        # shapes: SmolLM2-135M (30 layers, h 576, vocab 49152) and the cpu-demo's 8192-token draft vocab.
        path = os.environ.get("EYAS_CHECK_EXPORT")
        if not path:
            from transformers import LlamaConfig

            tcfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                               tie_word_embeddings=True)
            cfg = DrafterConfig.from_target(tcfg, draft_vocab_size=8192, aux_layer_ids=(2, 15, 27))
            torch.manual_seed(0)
            d = Eagle3Drafter(cfg)
            ids = torch.randperm(49152)[:8192].sort().values
            t2d = torch.zeros(49152, dtype=torch.bool)
            t2d[ids] = True
            d.set_vocab(ids - torch.arange(8192), t2d)
            path = export_drafter(d, tmp_path_factory.mktemp("smollm2"))
        return json.loads((Path(path) / "config.json").read_text()), load_file(Path(path) / "model.safetensors")
    target = target_from_model(make_tiny_llama(layers=TARGET_LAYERS), name="tiny")
    # EAGLE 3.1: both engines must build input_norm (3*h_t) from our config and fill it from our input_norm.weight
    nbf = request.param == "norm-before-fc"
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=DRAFT_VOCAB if nbf else request.param,
                                    aux_layer_ids=target.aux_layer_ids, norm_before_fc=nbf)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    out = export_drafter(d, tmp_path_factory.mktemp("exp"), meta={"target": target.fingerprint})
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def _hf(config):
    return NS(**json.loads(json.dumps(config)))


def _check_mapped(engine, params, mapped, tensors):
    """mapped: {our key: (engine param#shard, tensor)}; every engine param except embed_tokens is filled."""
    filled = {}
    for key, (pname, t) in mapped.items():
        assert pname in params, f"{engine} would silently drop {key!r} (mapped to {pname!r}, not a parameter)"
        spec = params[pname]
        if isinstance(spec, ParamSpec):
            assert tuple(t.shape) == spec.shape, f"{engine}: {key} {tuple(t.shape)} != {spec.shape}"
            assert spec.dtype == "torch.long" and t.dtype == torch.int64, f"{engine}: {key} dtype {t.dtype}"
        else:
            assert all(isinstance(s, int) for s in spec), f"{engine}: could not evaluate the shape of {pname}: {spec}"
            assert tuple(t.shape) == spec, f"{engine}: {key} {tuple(t.shape)} != {pname} {spec}"
            assert t.dtype == torch.bfloat16, f"{engine}: {key} is {t.dtype}"
        filled[pname] = key
    unfilled = sorted(set(params) - set(filled) - {"model.embed_tokens.weight"})
    assert not unfilled, f"{engine} parameters our export leaves at their init values: {unfilled}"


def test_sglang_weights(sglang, exported):
    config, tensors = exported
    mod = sglang["sglang.srt.models.llama_eagle3"]
    assert "LlamaForCausalLMEagle3" in ast.unparse(next(n for n in mod.tree.body if isinstance(n, ast.Assign)
                                                        and ast.unparse(n.targets[0]) == "EntryClass"))
    obj = Interpreter(sglang, {}).construct(mod, mod.classes["LlamaForCausalLMEagle3"], [_hf(config)], {})
    params = flatten(obj)
    assert obj.attrs["lm_head"].kind == "ParallelLMHead"          # untied: its own (draft-vocab) head
    lw = find_function(mod, "LlamaForCausalLMEagle3", "load_weights")
    legacy = assigned_literal(lw, "legacy_name_map")
    stacked = assigned_literal(lw, "stacked_params_mapping")
    assert substring_branches(lw) == {"d2t": "handled", "t2d": "skip"}, "SGLang changed its d2t/t2d handling"
    assert legacy["midlayer"] == "layers.0"
    mapped = {}
    for key, t in tensors.items():
        name = key
        for old, new in legacy.items():
            if old in name:
                name = name.replace(old, new)
        if "d2t" in name:   # hot_token_id = d2t + arange(draft_vocab)
            assert t.dtype == torch.int64 and tuple(t.shape) == (config["draft_vocab_size"],)
            continue
        if "t2d" in name:   # deliberately skipped by SGLang (kept for vLLM/eyas; documented)
            assert t.dtype == torch.bool and tuple(t.shape) == (config["vocab_size"],)
            continue
        real = {p.split("#")[0] for p in params}   # SGLang's params_dict (unsharded names)
        for param_name, weight_name, shard in stacked:
            if weight_name in name:
                name = name.replace(weight_name, param_name)
                pname = (name if name in real else f"model.{name}") + f"#{shard}"
                break
        else:
            pname = name if name in real else f"model.{name}"
        mapped[key] = (pname, t)
    # QKV/gate-up shards: our param table carries shard tags ("weight#q"); SGLang's stacked tuples use "q"/0/1.
    _check_mapped("sglang", params, mapped, tensors)
    # The target's embedding replaces the draft's (EAGLE-3 path calls set_embed), so not exporting it is safe.
    worker = ast.unparse(sglang["sglang.srt.speculative.eagle_worker_v2"].tree)
    assert "self.draft_runner.model.set_embed(embed)" in worker


def test_vllm_weights(vllm, exported):
    config, tensors = exported
    mod = vllm["vllm.model_executor.models.llama_eagle3"]
    registry = ast.unparse(vllm["vllm.model_executor.models.registry"].tree)
    assert "'LlamaForCausalLMEagle3': ('llama_eagle3', 'Eagle3LlamaForCausalLM')" in registry
    vc = NS(speculative_config=NS(draft_model_config=NS(hf_config=_hf(config)), parallel_drafting=False),
            model_config=NS(dtype="bfloat16"), cache_config=None)
    builtins = {"get_current_vllm_config": lambda: vc,
                "vllm_config.model_config.get_vocab_size": lambda: VOCAB,
                "vllm_config.model_config.get_total_num_hidden_layers": lambda: TARGET_LAYERS}
    obj = Interpreter(vllm, builtins).construct(mod, mod.classes["Eagle3LlamaForCausalLM"], [], {"vllm_config": vc})
    params = flatten(obj)
    lw = find_function(mod, "Eagle3LlamaForCausalLM", "load_weights")
    branches = substring_branches(lw)
    assert branches.get("t2d") == "skip" and replace_calls(lw).get("d2t") == "draft_id_to_target_id", \
        "vLLM changed its d2t/t2d handling"
    mapper = next(n for n in mod.classes["LlamaModel"].body if isinstance(n, ast.Assign)
                  and ast.unparse(n.targets[0]) == "hf_to_vllm_mapper").value
    kw = {k.arg: ast.literal_eval(k.value) for k in mapper.keywords}
    assert set(kw) == {"orig_to_new_substr", "orig_to_new_stacked"}, f"vLLM mapper changed: {sorted(kw)}"
    mapped = {}
    for key, t in tensors.items():
        if "t2d" in key:
            continue
        if "d2t" in key:
            mapped[key] = (key.replace("d2t", "draft_id_to_target_id"), t)
            continue
        if "lm_head" in key:
            mapped[key] = (key, t)
            continue
        name, shard = key, None
        for old, new in kw["orig_to_new_substr"].items():
            if old in name:
                name = name.replace(old, new, 1)
        for old, (new, sid) in kw["orig_to_new_stacked"].items():
            if old in name:
                name, shard = name.replace(old, new, 1), sid
        mapped[key] = ("model." + name + (f"#{shard}" if shard is not None else ""), t)
    if config["draft_vocab_size"] == config["vocab_size"]:
        assert "draft_id_to_target_id" not in params   # so a d2t key would raise in AutoWeightsLoader
    _check_mapped("vllm", params, mapped, tensors)


def test_config_fields(sglang, vllm, exported):
    config, _ = exported
    hf_ids = config["eagle_aux_hidden_state_layer_ids"]
    reads = {}
    for name, mod in {**sglang, **vllm}.items():
        if "eagle" in name:
            reads[name] = config_fields_read(mod.tree) | config_fields_read(mod.tree, ("self.config", "config"))
    read = set().union(*reads.values())
    unknown = sorted(read - set(config) - REVIEWED_ABSENT - LLAMA_FIELDS - {"eagle_config", "dflash_config",
                     "dspark_target_layer_ids", "target_layer_ids", "spec_hidden_size",
                     "text_config", "index_topk", "index_share_for_mtp_iteration"})   # DFlash/DSpark/DeepSeek paths
    assert not unknown, f"the EAGLE-3 loaders now read config fields we have not reviewed: {unknown}"
    ignored = sorted(set(config) - read - LLAMA_FIELDS - {"architectures", "torch_dtype", "eyas_target"})
    assert not ignored, f"we write config fields no EAGLE-3 loader reads: {ignored}"
    assert not (read & REVIEWED_ABSENT & set(config) - {"norm_before_fc"})
    assert config.get("norm_before_fc", False) is ("input_norm.weight" in exported[1])
    # eagle_config keys: SGLang reads the ids and use_aux_hidden_state from it.
    spec_aux = sglang["sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state"].tree
    assert {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"} <= dict_keys_read(spec_aux, "eagle_config")
    assert set(config["eagle_config"]) <= dict_keys_read(spec_aux, "eagle_config")
    # Layer-id conventions, read from the capture code: SGLang Llama adds 1, vLLM uses the top-level ids as is.
    llama = ast.unparse(find_function(sglang["sglang.srt.models.llama"], "LlamaForCausalLM",
                                      "set_eagle3_layers_to_capture"))
    assert "[val + 1 for val in layer_ids]" in llama
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == hf_ids
    ds = ast.unparse(find_function(sglang["sglang.srt.models.deepseek_v2"], "DeepseekV2ForCausalLM",
                                   "set_eagle3_layers_to_capture"))
    assert re.search(r"layer_ids\[0\] == 1", ds), "SGLang's DeepSeek +1 quirk changed; revisit export.py"
    vfn = ast.unparse(vllm["vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"].tree)
    assert "layer_ids = getattr(hf_config, 'eagle_aux_hidden_state_layer_ids', None)" in vfn
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 1
    assert set(LLAMA_FIELDS) - {"attention_bias"} <= set(config) | {"rope_scaling"}


def test_checker_catches_bad_exports(sglang, vllm, exported):
    """The checks above are not vacuous: a misspelt key or a wrong shape fails them."""
    config, tensors = exported
    renamed = dict(tensors)
    renamed["midlayer.hiddennorm.weight"] = renamed.pop("midlayer.hidden_norm.weight")   # silently dropped
    for check, src in ((test_sglang_weights, sglang), (test_vllm_weights, vllm)):
        with pytest.raises(AssertionError, match="drop"):
            check(src, (config, renamed))
    reshaped = {**tensors, "fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}
    with pytest.raises(AssertionError, match="fc.weight"):
        test_vllm_weights(vllm, (config, reshaped))
