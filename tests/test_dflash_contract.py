"""Our DFlash export vs the real SGLang / vLLM DFlash loaders (pinned in eyas.export.engine_pins).

As in tests/test_engine_contract.py, the loaders are parsed, not imported: tests/support/engine_contract.py instantiates
SGLang's DFlashDraftModel and vLLM's DFlashQwen3ForCausalLM abstractly with our config.json, and the tests replay
their load_weights name mapping (its literals read from the source) over our model.safetensors. SGLang ignores a
name it cannot place without a word, so "every tensor we write lands on a parameter" is the check that matters
there; every engine parameter must be filled with the right shape (embed_tokens, lm_head and vLLM's mask_embedding
excepted: the target's, and the target's mask row); every config field the DFlash code reads is one we write or one
whose absence is reviewed below.
"""

import ast
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from support import engine_wheels
from support.models import make_tiny_llama
from support.engine_contract import NS, Interpreter, Module, ParamSpec, config_fields_read, dict_keys_read, find_function, \
    flatten
from eyas.export.export import export_drafter
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.model.dflash_import import NEUTRAL_KEYS, USED_KEYS

TARGET_LAYERS, VOCAB = 8, 256

# Top-level fields the DFlash code reads that we deliberately do NOT write (absent = the default we want).
REVIEWED_ABSENT = {
    "target_hidden_size",        # vLLM: fc input width; absent = hidden_size (export refuses any other width)
    "text_config", "get_text_config",   # SGLang: a multimodal wrapper; ours is the text config itself
    "sliding_window", "swa_window_size", "use_swa",   # sliding-window layers only; ours are all full attention
    "use_gemma_norm",            # SGLang: (1 + w) norms; absent = plain RMSNorm, as eyas trains
    "is_neox_style", "rope_is_neox_style",   # absent = neox (rotate_half), eyas's RoPE
    "partial_rotary_factor",     # absent = 1.0: RoPE on the whole head
    "rope_parameters",           # transformers 5 spelling; AutoConfig derives it from rope_theta / rope_scaling
    "swiglu_alpha", "swiglu_limit",   # only for hidden_act swigluoai
    "add_swa_attention_sink_bias", "attention_sink_bias",   # sinks: absent = none
    "mask_token",                # SGLang: tokenizer lookup, used only without mask_token_id (we write the id)
    "mask_token_id",             # we write it in dflash_config, where every engine looks first
    "target_layer_ids", "num_target_layers", "block_size",   # read from dflash_config first; also written top
    "projector_type", "shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim",   # Domino projector
    "use_aux_hidden_state",      # absent = True: the context path through fc
    "eagle_config",              # vLLM would take layer ids from it; must stay absent
    "draft_vocab_size",          # vLLM: absent = vocab_size, the full target head
    "has_own_lm_head", "logit_scale",   # absent = the target's head, unscaled
    "quantization_config", "has_embed_tokens", "has_lm_head", "quant_algo",   # SGLang's Nemotron-3.5 drafts
    "eagle_aux_hidden_state_layer_ids",   # vLLM would take these ids as they are, over dflash_config's (+1)
    "sample_from_anchor",        # DSpark drafting from the anchor slot; absent = DFlash's slots 1..B-1
}
# Written for HF AutoConfig / people, not read by the DFlash code itself.
WRITTEN_FOR_HF = {"architectures", "model_type", "torch_dtype", "eyas_target", "tie_word_embeddings",
                  "use_sliding_window"}
# Read through helpers, not as fields: SGLang's get_rope_config(config), vLLM's config.rope_parameters (which HF's
# Qwen3Config derives from these two); test_config_fields asserts both calls.
ROPE_FIELDS = {"rope_theta", "rope_scaling"}
SGLANG_CODE = ("DFlashAttention", "DFlashMLP", "DFlashDecoderLayer", "DFlashDraftModel", "_get_dflash_attention_type",
               "_get_dflash_layer_attention_params")
VLLM_CODE = ("DFlashQwen3Attention", "DFlashQwen3DecoderLayer", "DFlashQwen3Model", "DFlashQwen3ForCausalLM",
             "_resolve_layer_attention", "_dflash_layer_causal", "_get_dflash_fc_input_size")


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


@pytest.fixture(scope="module", params=["tiny-llama", "wide-heads"])
def exported(request, tmp_path_factory):
    target = make_tiny_llama(layers=TARGET_LAYERS)
    if request.param == "tiny-llama":
        cfg = DFlashConfig.from_target(target.config, aux_layer_ids=(1, 3, 5), mask_token_id=7, num_layers=2,
                                       block_size=4)
    else:   # head_dim * heads != hidden: a config field left out would show as a wrong shape
        cfg = DFlashConfig(hidden_size=64, target_hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                           rope_theta=1e6, max_position_embeddings=4096, vocab_size=VOCAB, aux_layer_ids=(2, 4),
                           num_target_layers=TARGET_LAYERS, block_size=16, mask_token_id=255)
    torch.manual_seed(0)
    out = export_drafter(DFlashDrafter(cfg), tmp_path_factory.mktemp("dflash"))
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def _hf(config):
    return NS(**json.loads(json.dumps(config)))


def _sglang_draft_config(config):
    """SGLang's parse_dflash_draft_config on our config, as its source reads it (dflash_config first, then the top
    level; test_config_fields asserts those reads): the fields DFlashDraftModel.__init__ uses."""
    dc = config["dflash_config"]
    pick = lambda k, d=None: dc.get(k, config.get(k, d))   # noqa: E731
    return NS(num_target_layers=pick("num_target_layers"), target_layer_ids=pick("target_layer_ids"),
              block_size=pick("block_size"), mask_token_id=pick("mask_token_id"),
              attention_value_scale=dc.get("attention_value_scale"),
              attention_sink_bias=dc.get("attention_sink_bias", False), conv_kernel_size=dc.get("conv_kernel_size", 0),
              projector_type=pick("projector_type"), shift_label=None, is_domino=False)


def _check_mapped(engine, params, mapped, allowed_unfilled):
    """mapped: {our key: engine param#shard}; every key lands on a parameter of its shape, every parameter but the
    allowed ones is filled."""
    for key, (pname, t) in mapped.items():
        assert pname in params, f"{engine} would silently drop {key!r} (mapped to {pname!r}, not a parameter)"
        spec = params[pname]
        shape = spec.shape if isinstance(spec, ParamSpec) else spec
        assert all(isinstance(s, int) for s in shape), f"{engine}: could not evaluate the shape of {pname}: {shape}"
        assert tuple(t.shape) == tuple(shape), f"{engine}: {key} {tuple(t.shape)} != {pname} {tuple(shape)}"
        assert t.dtype == torch.bfloat16, f"{engine}: {key} is {t.dtype}"
    filled = {p for p, _ in mapped.values()}
    unfilled = sorted(set(params) - filled - allowed_unfilled)
    assert not unfilled, f"{engine} parameters our export leaves at their init values: {unfilled}"


def test_sglang_weights(sglang, exported):
    config, tensors = exported
    mod = sglang["sglang.srt.models.dflash"]
    entry = next(n for n in mod.tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "EntryClass")
    assert "DFlashDraftModel" in ast.unparse(entry.value)      # dispatch on architectures[0]
    dcfg = _sglang_draft_config(config)
    n_target = dcfg.num_target_layers
    assert n_target is not None, "no num_target_layers: SGLang 0.5.14 would check the ids against the draft's depth"
    assert all(0 <= i < n_target for i in dcfg.target_layer_ids), "resolve_target_layer_ids would refuse our ids"
    builtins = {"get_parallel": lambda: NS(tp_size=1), "parse_dflash_draft_config": lambda: dcfg,
                "is_nemotron_35_draft_config": lambda: False,
                "draft_config.resolve_block_size": lambda: dcfg.block_size or 16,
                "draft_config.resolve_target_layer_ids": lambda: list(dcfg.target_layer_ids)}
    obj = Interpreter(sglang, builtins).construct(mod, mod.classes["DFlashDraftModel"], [_hf(config)], {})
    params = flatten(obj)
    assert params["fc.weight"] == (config["hidden_size"], len(config["dflash_config"]["target_layer_ids"])
                                   * config["hidden_size"])
    lw = find_function(mod, "DFlashDraftModel", "load_weights")
    stacked = next(ast.literal_eval(n.value) for n in ast.walk(lw) if isinstance(n, ast.Assign)
                   and ast.unparse(n.targets[0]) == "stacked_params_mapping")
    aliases = next(ast.literal_eval(n.value) for n in ast.walk(lw) if isinstance(n, ast.Assign)
                   and ast.unparse(n.targets[0]) == "_VENDOR_ENCODER_ALIASES")
    assert "# Ignore unexpected weights" in mod.path.read_text(), "SGLang now refuses unknown names; simplify here"
    real = {p.split("#")[0] for p in params}                   # SGLang's params_dict (unsharded names)

    def resolve(name):                                         # load_weights' resolve_param_name
        for cand in (name, name.removeprefix("model.") if name.startswith("model.") else f"model.{name}",
                     aliases.get(name)):
            if cand in real:
                return cand
        return None

    mapped = {}
    for key, t in tensors.items():
        for param_name, weight_name, shard in stacked:
            if f".{weight_name}." in key and (r := resolve(key.replace(weight_name, param_name))) is not None:
                mapped[key] = (f"{r}#{shard}", t)
                break
        else:
            mapped[key] = (resolve(key) or f"<ignored {key}>", t)
    _check_mapped("sglang", params, mapped, {"embed_tokens.weight"})   # only Nemotron-3.5 drafts build it


def _vllm_mapper(mod):
    """DFlashQwen3Model.hf_to_vllm_mapper's regex renames and stacked map, from the source literals."""
    mapper = next(n for n in mod.classes["DFlashQwen3Model"].body if isinstance(n, ast.Assign)
                  and ast.unparse(n.targets[0]) == "hf_to_vllm_mapper").value
    kw = {k.arg: k.value for k in mapper.keywords}
    assert set(kw) == {"orig_to_new_regex", "orig_to_new_stacked"}, f"vLLM mapper changed: {sorted(kw)}"
    regex = {ast.literal_eval(k.args[0]): ast.literal_eval(v) for k, v in zip(kw["orig_to_new_regex"].keys,
                                                                            kw["orig_to_new_regex"].values)}
    return regex, ast.literal_eval(kw["orig_to_new_stacked"])


def test_vllm_weights(vllm, exported):
    config, tensors = exported
    mod = vllm["vllm.model_executor.models.qwen3_dflash"]
    registry = ast.unparse(vllm["vllm.model_executor.models.registry"].tree)
    assert "'DFlashDraftModel': ('qwen3_dflash', 'DFlashQwen3ForCausalLM')" in registry
    # The fc width comes from the aux layers vLLM resolves: top-level eagle ids first (absent in ours), then
    # dflash_config.target_layer_ids + 1.
    aux_src = ast.unparse(find_function_any(vllm["vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"],
                                            "get_eagle3_aux_layers_from_config"))
    assert "layer_ids = getattr(hf_config, 'eagle_aux_hidden_state_layer_ids', None)" in aux_src
    assert "[i + 1 for i in dflash_config.get('target_layer_ids') or []]" in aux_src
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
    aux = tuple(i + 1 for i in config["dflash_config"]["target_layer_ids"])
    vc = NS(speculative_config=NS(draft_model_config=NS(hf_config=_hf(config))), model_config=NS(dtype="bfloat16"),
            cache_config=None)
    builtins = {"get_current_vllm_config": lambda: vc, "get_tensor_model_parallel_world_size": lambda: 1,
                "get_eagle3_aux_layers_from_config": lambda: aux,
                "vllm_config.model_config.get_vocab_size": lambda: VOCAB,
                "vllm_config.model_config.get_total_num_hidden_layers": lambda: TARGET_LAYERS}
    obj = Interpreter(vllm, builtins).construct(mod, mod.classes["DFlashQwen3ForCausalLM"], [], {"vllm_config": vc})
    params = flatten(obj)
    assert "draft_id_to_target_id" not in params      # full vocab: no d2t parameter (and none written)
    top = ast.unparse(find_function(mod, "DFlashQwen3ForCausalLM", "load_weights"))
    assert "name = 'model.' + name" in top and "orig_to_new_substr['embed_tokens'] = None" in top
    assert "orig_to_new_substr['mask_embedding'] = None" in top   # no sidecar: the target's mask row
    regex, stacked = _vllm_mapper(mod)
    mapped = {}
    for key, t in tensors.items():
        name, shard = key, None          # inner loader: `model.` stripped by AutoWeightsLoader's child dispatch
        for pattern, new in regex.items():
            name = re.sub(pattern, new, name)
        for old, (new, sid) in stacked.items():
            if old in name:
                name, shard = name.replace(old, new, 1), sid
        mapped[key] = ("model." + name + (f"#{shard}" if shard is not None else ""), t)
    _check_mapped("vllm", params, mapped, {"model.embed_tokens.weight", "model.mask_embedding", "lm_head.weight"})


def find_function_any(mod, name):
    return next(n for n in mod.tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _code(mod, names):
    """The ASTs of the named classes and module-level functions of mod."""
    return [n for n in mod.tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names]


def _cfg_get_reads(tree):
    """Keys read with SGLang's `_cfg_get(config, "key", ...)`."""
    return {n.args[1].value for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "_cfg_get"
            and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)}


def check_causality(config):
    """Bidirectional inside the block, stated in the key each engine reads (docs/export.md)."""
    assert config.get("is_causal") is False, "top-level is_causal: false missing (SGLang 0.5.23, vLLM 0.33)"
    assert config["dflash_config"].get("causal") is False, "dflash_config.causal: false missing (vLLM 0.25)"
    assert config.get("layer_types") == ["full_attention"] * config["num_hidden_layers"]


def test_config_fields(sglang, vllm, exported):
    config, _ = exported
    sg, utils = sglang["sglang.srt.models.dflash"], sglang["sglang.srt.speculative.dflash_utils"].tree
    vl = vllm["vllm.model_executor.models.qwen3_dflash"]
    names = ("config", "self.config", "text_config", "hf_config")
    read = set()
    for node in _code(sg, SGLANG_CODE) + _code(vl, VLLM_CODE):
        read |= config_fields_read(node, names)
    read |= _cfg_get_reads(utils)
    dflash_keys = dict_keys_read(utils, "dflash_cfg")
    for node in _code(vl, VLLM_CODE):
        dflash_keys |= dict_keys_read(node, "dflash_config") | dict_keys_read(node, "drafter_config")
        dflash_keys |= {n.args[0].value for n in ast.walk(node) if isinstance(n, ast.Call)   # (... dflash_config
                        and isinstance(n.func, ast.Attribute) and n.func.attr == "get"       # ... or {}).get("k")
                        and "dflash_config" in ast.unparse(n.func.value) and n.args
                        and isinstance(n.args[0], ast.Constant)}
    # SGLang takes these from dflash_config first, then the top level: we write both (and vLLM reads dflash_config).
    assert {"target_layer_ids", "num_target_layers", "block_size", "mask_token_id"} <= dflash_keys
    assert {"target_layer_ids", "num_target_layers", "block_size"} <= _cfg_get_reads(utils)
    unknown = sorted(read - set(config) - REVIEWED_ABSENT - {"dflash_config"})
    assert not unknown, f"the DFlash loaders now read config fields we have not reviewed: {unknown}"
    ignored = sorted(set(config) - read - WRITTEN_FOR_HF - ROPE_FIELDS - {"dflash_config"})
    assert "get_rope_config(config)" in ast.unparse(sg.classes["DFlashAttention"])
    assert "rope_parameters=config.rope_parameters" in ast.unparse(vl.classes["DFlashQwen3DecoderLayer"])
    assert not ignored, f"we write config fields no DFlash loader reads: {ignored}"
    assert not (set(config) & REVIEWED_ABSENT - {"target_layer_ids", "num_target_layers", "block_size"})
    assert set(config["dflash_config"]) <= dflash_keys, "we write a dflash_config key no engine reads"
    # eyas's importer knows every dflash_config key the engines read (and refuses the others by name).
    unknown_to_importer = sorted(dflash_keys - USED_KEYS - set(NEUTRAL_KEYS))
    assert not unknown_to_importer, f"engines read dflash_config keys the importer does not know: {unknown_to_importer}"
    # Causality, read from the code: SGLang 0.5.23 maps is_causal False to ENCODER_ONLY (bidirectional); vLLM reads
    # is_causal, then dflash_config.causal.
    sg_src = "\n".join(ast.unparse(n) for n in _code(sg, SGLANG_CODE))
    assert "getattr(text_config, 'is_causal', None)" in sg_src
    assert "AttentionType.DECODER if is_causal else AttentionType.ENCODER_ONLY" in sg_src
    vl_src = ast.unparse(find_function_any(vl, "_dflash_layer_causal"))
    assert "getattr(config, 'is_causal', None)" in vl_src and ".get('causal')" in vl_src
    check_causality(config)
    assert config["block_size"] == config["dflash_config"]["block_size"]
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == VOCAB


def test_checker_catches_bad_exports(sglang, vllm, exported):
    """The checks above are not vacuous: a misspelt key, a wrong fc width and a missing causal key fail them."""
    config, tensors = exported
    renamed = dict(tensors)
    renamed["layers.0.self_attn.knorm.weight"] = renamed.pop("layers.0.self_attn.k_norm.weight")
    with pytest.raises(AssertionError, match="silently drop 'layers.0.self_attn.knorm.weight'"):
        test_sglang_weights(sglang, (config, renamed))
    with pytest.raises(AssertionError, match="knorm"):
        test_vllm_weights(vllm, (config, renamed))
    h = config["hidden_size"]
    reshaped = {**tensors, "fc.weight": torch.zeros(h, h, dtype=torch.bfloat16)}
    for check, src in ((test_sglang_weights, sglang), (test_vllm_weights, vllm)):
        with pytest.raises(AssertionError, match="fc.weight"):
            check(src, (config, reshaped))
    no_causal = {k: v for k, v in config.items() if k != "is_causal"}
    with pytest.raises(AssertionError, match="is_causal"):
        check_causality(no_causal)
    no_n = {**config, "dflash_config": {k: v for k, v in config["dflash_config"].items() if k != "num_target_layers"}}
    del no_n["num_target_layers"]
    with pytest.raises(AssertionError, match="num_target_layers"):
        test_sglang_weights(sglang, (no_n, tensors))
