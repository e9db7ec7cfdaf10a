"""The weightless target reader (target/meta.py), the weights' hash cache (target/fingerprint.py), the in-process
load's memory check (target/load.py), the drafter's RoPE (model/shape.py) and `bench --engine`'s stop ids
(bench/engine.py), in the cases where a one-line change of them went unnoticed before.

The directories are written by the tests: the weightless DeepSeek-V3 twin (config, tokenizer, index, head shards)
with a tensor added, renamed or its config changed, and a tiny Llama saved whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import eyas.target.device as device
from support.models import make_tiny_llama
from support.deepseek_twin import save_twin, twin_tokenizer, weightless_copy
from eyas.bench.engine import open_tokenizer
from eyas.errors import EyasError
from eyas.model.drafter import DrafterConfig, Eagle3Drafter, rope_inv_freq
from eyas.target import load_target
from eyas.target.fingerprint import file_sha256
from eyas.target.load import weights_of
from eyas.target.meta import JsonConfig, open_target_meta, safetensors_header

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def wl(tmp_path_factory):
    """The weightless twin (fp32 head tensors), with a private hash cache for the module."""
    root = tmp_path_factory.mktemp("twin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EYAS_CACHE", str(root / "cache"))
        yield weightless_copy(save_twin(root / "full"), root / "weightless")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))


def copy_of(wl: Path, out: Path, *, add: dict | None = None, rename: dict | None = None, config=None) -> Path:
    """A copy of the weightless twin: tensors `add`ed to the LM head's shard, tensors `rename`d (old -> new, in
    their shard and the index), config.json passed through `config`."""
    d = Path(shutil.copytree(wl, out))
    index = json.loads((d / INDEX).read_text())
    wm = index["weight_map"]
    shard = wm["lm_head.weight"]
    for old, new in (rename or {}).items():
        held = load_file(d / wm[old])
        held[new] = held.pop(old)
        save_file(held, d / wm[old])
        wm[new] = wm.pop(old)
    if add:
        held = load_file(d / shard)
        held.update(add)
        save_file(held, d / shard)
        wm.update({k: shard for k in add})
    (d / INDEX).write_text(json.dumps(index))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config(json.loads((d / "config.json").read_text()))))
    return d


# ------------------------------------------------------------------ target/meta.py

def test_a_float_head_with_a_quantization_scale_beside_it_is_refused(wl, tmp_path):
    """lm_head.weight in fp32 with lm_head.weight_scale (or weight_packed) beside it holds quantized values
    stored as floats: reading it as plain weights would give a wrong head."""
    for companion in ("weight_scale", "weight_packed"):
        d = copy_of(wl, tmp_path / companion, add={f"lm_head.{companion}": torch.ones(4)})
        with pytest.raises(EyasError, match=rf"lm_head.weight is quantized \(dtype F32 with lm_head.{companion}\)"):
            open_target_meta(str(d))
    assert open_target_meta(str(wl)).lm_head.weight.dtype == torch.float32          # without it: read as it is


def test_a_known_model_type_with_an_auto_map_opens_without_remote_code(wl, tmp_path):
    """DeepSeek-V3's config.json maps its own AutoConfig class, but transformers knows deepseek_v3: no code from
    the checkpoint runs, so no --trust-remote-code is needed. An unknown model type with the same map needs it."""
    auto = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    known = copy_of(wl, tmp_path / "known", config=lambda c: {**c, "auto_map": auto})
    meta = open_target_meta(str(known))
    assert meta.config.model_type == "deepseek_v3" and meta.num_layers == 7
    unknown = copy_of(wl, tmp_path / "unknown", config=lambda c: {**c, "auto_map": auto, "model_type": "deepseek_x"})
    with pytest.raises(EyasError, match=r"needs its own code \(config.json auto_map.AutoConfig"):
        open_target_meta(str(unknown))


def test_an_ambiguous_head_name_is_refused_naming_the_candidates(wl, tmp_path):
    """Two tensors outside the layers end in `.lm_head.weight` (say a text and a speech head): the reader cannot
    tell which is the language model's, so it refuses, naming both, instead of taking the first by name or, where
    config.json does not say whether the head is tied, reading the missing head as the embedding."""
    head = load_file(wl / json.loads((wl / INDEX).read_text())["weight_map"]["lm_head.weight"])["lm_head.weight"]
    rename = {"lm_head.weight": "thinker.lm_head.weight"}
    add = {"speech.lm_head.weight": torch.zeros_like(head)}
    d = copy_of(wl, tmp_path / "two", rename=rename, add=add)
    with pytest.raises(EyasError, match=r"2 tensors could be the lm_head \(speech.lm_head.weight, "
                                        r"thinker.lm_head.weight\)"):
        open_target_meta(str(d))

    def untold(c):  # a wrapper transformers lacks, no tie_word_embeddings: read as JSON, whether tied unknown
        text = {k: v for k, v in c.items() if k != "tie_word_embeddings"} | {"model_type": "kimi_k2"}
        return {"model_type": "vlm_x", "architectures": ["VlmXForConditionalGeneration"], "text_config": text}
    raw = copy_of(wl, tmp_path / "raw", rename=rename, add=add, config=untold)
    with pytest.raises(EyasError, match=r"2 tensors could be the lm_head"):
        open_target_meta(str(raw))
    one = copy_of(wl, tmp_path / "one", rename=rename, config=untold)          # one candidate: it is the head
    meta = open_target_meta(str(one))
    assert isinstance(meta.config, JsonConfig) and not meta.tie_word_embeddings
    assert torch.equal(meta.lm_head.weight, head)


def test_the_dtype_asked_for_is_the_dtype_read(wl):
    """open_target_meta(dtype=...) converts the head tensors on read (the twin stores them in fp32)."""
    stored = open_target_meta(str(wl))
    for dtype in (torch.bfloat16, torch.float16):
        meta = open_target_meta(str(wl), dtype=dtype)
        assert meta.dtype == dtype
        for k in ("embed_tokens", "lm_head", "final_norm"):
            w, ref = getattr(meta, k).weight, getattr(stored, k).weight
            assert ref.dtype == torch.float32 and w.dtype == dtype and torch.equal(w, ref.to(dtype))


# ------------------------------------------------------------------ target/fingerprint.py: the hash cache

def replace_keeping_size_and_mtime(f: Path, data: bytes) -> None:
    """Move a same-size file with other bytes over f, its mtime set to f's (what `rsync -t` does)."""
    st = f.stat()
    assert len(data) == st.st_size
    tmp = f.with_name(f.name + ".new")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, f)
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_a_file_replaced_with_its_size_and_mtime_kept_is_hashed_again(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    assert file_sha256(f) == hashlib.sha256(b"a" * 1000).hexdigest()
    replace_keeping_size_and_mtime(f, b"b" * 1000)
    assert file_sha256(f) == hashlib.sha256(b"b" * 1000).hexdigest()


def test_a_head_shard_replaced_with_its_size_and_mtime_kept_changes_the_weights_identity(wl, tmp_path):
    """The fingerprint's weights hash only the head tensors' byte ranges, cached like whole files: a head shard
    replaced by one with another LM head (same size, same mtime) gives another identity, as a cold cache does."""
    d = Path(shutil.copytree(wl, tmp_path / "t"))
    shard = d / json.loads((d / INDEX).read_text())["weight_map"]["lm_head.weight"]
    before = weights_of(str(d))
    header, base = safetensors_header(shard)
    start, end = (base + o for o in header["lm_head.weight"]["data_offsets"])
    data = bytearray(shard.read_bytes())
    data[start:end] = data[start:end][::-1]                          # another LM head, the same layout
    replace_keeping_size_and_mtime(shard, bytes(data))
    after = weights_of(str(d))
    shutil.rmtree(tmp_path / "cache")
    assert after == weights_of(str(d)) != before


# ------------------------------------------------------------------ target/load.py

def test_a_device_map_load_is_not_refused_against_one_devices_free_memory(tmp_path, monkeypatch):
    """With a device_map the weights spread over several devices: the check of one device's free memory does not
    apply. Without one it refuses before reading a weight."""
    model = make_tiny_llama()
    model.save_pretrained(tmp_path / "t")
    monkeypatch.setattr(device, "free_bytes", lambda dev: 1024)            # 1 KB free on every device
    with pytest.raises(EyasError, match="cannot be loaded in process"):
        load_target(str(tmp_path / "t"))
    target = load_target(str(tmp_path / "t"), device_map={"": "cpu"})
    assert torch.equal(target.lm_head.weight, model.lm_head.weight)


# ------------------------------------------------------------------ model/shape.py

@pytest.mark.parametrize("scaling", [{"rope_type": "dynamic", "factor": 2.0},
                                     {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                      "original_max_position_embeddings": 256}], ids=["dynamic", "longrope"])
def test_a_rope_scaling_the_drafter_lacks_gives_plain_rope_at_the_targets_theta(scaling):
    """docs/training.md: a scaling the drafter does not implement is dropped for plain RoPE at the target's theta
    (the drafter is built), while one it implements is kept."""
    c = {k: v for k, v in make_tiny_llama().config.to_dict().items() if k != "rope_parameters"}
    cfg = DrafterConfig.from_target({**c, "rope_theta": 5e5, "rope_scaling": scaling}, draft_vocab_size=64,
                                    aux_layer_ids=(1, 2, 3))
    plain = DrafterConfig.from_target({**c, "rope_theta": 5e5}, draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    assert cfg == plain and cfg.rope_scaling is None and cfg.rope_theta == 5e5
    assert torch.equal(rope_inv_freq(cfg), rope_inv_freq(plain))
    Eagle3Drafter(cfg)
    linear = DrafterConfig.from_target({**c, "rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                       draft_vocab_size=64, aux_layer_ids=(1, 2, 3))
    assert linear.rope_scaling["rope_type"] == "linear"


# ------------------------------------------------------------------ bench/engine.py

def test_a_wrappers_text_config_eos_is_a_stop_id_of_bench_engine(tmp_path):
    """A VLM wrapper declares its eos in text_config only: `bench --engine` stops at it, as the in-process rule
    (target/load.py eos_ids) does."""
    tok = twin_tokenizer()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"]}))
    _, plain = open_tokenizer(str(tmp_path))                       # the tokenizer's own eos and end-of-turn ids
    assert tok.eos_token_id in plain and not {7, 9} & set(plain)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                      "text_config": {"eos_token_id": [7, 9]}}))
    _, eos = open_tokenizer(str(tmp_path))
    assert eos == sorted({*plain, 7, 9})
