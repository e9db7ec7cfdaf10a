"""Export -> import round trips and the importer's refusals (tiny random target, CPU, seconds)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.models import make_tiny_llama
from support.drafters import eagle3_for_target
from eyas.errors import EyasError
from eyas.export.export import export_drafter
from eyas.model.checkpoint import open_drafter, save_drafter
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.model.importer import load_eagle3_checkpoint
from eyas.target import target_from_model

DRAFT_VOCAB = 100


@pytest.fixture
def target():
    return target_from_model(make_tiny_llama(layers=8), name="tiny")


def test_export_layout(target, tmp_path):
    d = eagle3_for_target(target)
    out = export_drafter(d, tmp_path / "x", meta={"target": target.fingerprint})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]                      # HF ids (2, N//2, N-3), N=8
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]      # SGLang: HF - 1
    assert cfg["vocab_size"] == 256 and cfg["draft_vocab_size"] == DRAFT_VOCAB and not cfg["tie_word_embeddings"]
    assert "target_hidden_size" not in cfg and cfg["torch_dtype"] == "bfloat16"
    assert cfg["max_position_embeddings"] >= target.config.max_position_embeddings
    assert cfg["rope_theta"] == 10000.0
    w = load_file(out / "model.safetensors")
    assert not any("embed" in k for k in w)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in w.items() if k not in ("d2t", "t2d"))
    assert set(w) == set(d.state_dict())
    readme = (out / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path" in readme and '"method": "eagle3"' in readme


def test_full_vocab_omits_identity_maps(target, tmp_path):
    d = eagle3_for_target(target, draft_vocab=256)
    out = export_drafter(d, tmp_path / "x")
    assert "d2t" not in load_file(out / "model.safetensors")     # vLLM refuses d2t when draft vocab == vocab
    back, _ = load_eagle3_checkpoint(out, target=target)
    assert torch.equal(back.d2t, torch.zeros(256, dtype=torch.int64)) and bool(back.t2d.all())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip(target, tmp_path, dtype):
    d = eagle3_for_target(target)
    out = export_drafter(d, tmp_path / dtype, meta={"target": target.fingerprint}, dtype=dtype)
    back, meta = load_eagle3_checkpoint(out, target=target)
    assert back.config == d.config and meta["warnings"] == []
    ref, got = d.state_dict(), back.state_dict()
    assert set(ref) == set(got)
    for k in ref:
        want = ref[k] if dtype == "fp32" or not ref[k].is_floating_point() else ref[k].bfloat16().float()
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], want), k


def test_run_dir_and_load_any(target, tmp_path):
    d = eagle3_for_target(target)
    save_drafter(d, tmp_path / "run" / "drafter", meta={"target": target.fingerprint})
    from eyas.export.export import run_export

    out = run_export(tmp_path / "run", tmp_path / "exp", dtype="fp32")
    a, ma = open_drafter(tmp_path / "run", target=target)
    b, mb = open_drafter(out, target=target)
    assert ma["format"] == "eyas" and mb["format"] == "eagle3" and mb["target"] == target.fingerprint
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    other = target_from_model(make_tiny_llama(layers=8, seed=5, rope_theta=5e5), name="tiny")
    with pytest.raises(EyasError, match="target"):
        open_drafter(out, target=other)
    with pytest.raises(EyasError, match="target"):
        export_drafter(d, tmp_path / "bad", meta={"target": target.fingerprint}, target=other)


def _published(target, tmp_path, *, rename=None, drop=(), extra=None, cfg_edit=None):
    """An exported dir rewritten into another published layout."""
    d = eagle3_for_target(target)
    out = export_drafter(d, tmp_path / "pub", dtype="fp32")
    w = load_file(out / "model.safetensors")
    w = {(rename(k) if rename else k): v for k, v in w.items() if k not in drop}
    w.update(extra or {})
    save_file(w, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return d, out


def test_published_layouts(target, tmp_path, caplog):
    def edit(cfg):
        cfg["architectures"] = ["LlamaForCausalLM"]
        del cfg["eagle_aux_hidden_state_layer_ids"]                      # only SGLang's ids
    d, out = _published(target, tmp_path, rename=lambda k: k.replace("midlayer.", "layers.0."), drop=("t2d",),
                        extra={"embed_tokens.weight": torch.zeros(256, 64)}, cfg_edit=edit)
    back, meta = load_eagle3_checkpoint(out, target=target)
    assert back.config.aux_layer_ids == (2, 4, 5)
    assert any("embed_tokens" in m for m in meta["warnings"])
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k                   # t2d rebuilt from d2t


def test_absent_layer_ids_use_default(target, tmp_path):
    def edit(cfg):
        del cfg["eagle_aux_hidden_state_layer_ids"], cfg["eagle_config"]
    _, out = _published(target, tmp_path, cfg_edit=edit)
    back, meta = load_eagle3_checkpoint(out, target=target)
    assert back.config.aux_layer_ids == (2, 4, 5) and "default" in meta["warnings"][0]
    with pytest.raises(EyasError, match="pass the target"):
        load_eagle3_checkpoint(out)


@pytest.mark.parametrize("case,match", [
    ("disagree", "layer ids disagree"),
    ("missing", r"missing \['midlayer.mlp.up_proj.weight'\]"),
    ("extra", r"unexpected \['midlayer.foo.weight'\]"),
    ("shape", r"wrong shape \['fc.weight \(64, 10\)"),
    ("d2t_range", "outside the target vocab"),
    ("t2d_wrong", "t2d does not mark"),
])
def test_bad_checkpoints(target, tmp_path, case, match):
    kw = {}
    if case == "disagree":
        kw["cfg_edit"] = lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 4, 5])
    elif case == "missing":
        kw["drop"] = ("midlayer.mlp.up_proj.weight",)
    elif case == "extra":
        kw["extra"] = {"midlayer.foo.weight": torch.zeros(3)}
    elif case == "shape":
        kw["extra"] = {"fc.weight": torch.zeros(64, 10)}
    elif case == "d2t_range":
        d2t = torch.zeros(DRAFT_VOCAB, dtype=torch.int64)
        d2t[-1] = 10_000
        kw.update(extra={"d2t": d2t}, drop=("t2d",))
    elif case == "t2d_wrong":
        kw["extra"] = {"t2d": torch.ones(256, dtype=torch.bool)}
    _, out = _published(target, tmp_path, **kw)
    with pytest.raises(EyasError, match=match):
        load_eagle3_checkpoint(out, target=target)
