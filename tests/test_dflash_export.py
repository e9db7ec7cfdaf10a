"""DFlash export -> import round trips and the importer's refusals (tiny random target, CPU, seconds)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.export.export import export_drafter, run_export
from eyas.model.checkpoint import open_drafter, save_drafter
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.model.dflash_import import load_dflash_checkpoint
from eyas.target import target_from_model

from support.drafters import eagle3_for_target

MASK = 7


@pytest.fixture(scope="module")
def target():
    return target_from_model(make_tiny_llama(layers=8), name="tiny")


def make_dflash(target, *, aux=(1, 2, 3), seed=1, block=4):
    cfg = DFlashConfig.from_target(target.config, aux_layer_ids=aux, mask_token_id=MASK, num_layers=2,
                                   block_size=block)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():   # non-trivial norms so a swapped or dropped norm would show
        for n, p in d.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return d


def _edit(out, *, cfg_edit=None, w_edit=None):
    if cfg_edit:
        cfg = json.loads((out / "config.json").read_text())
        cfg_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if w_edit:
        w = load_file(out / "model.safetensors")
        w_edit(w)
        save_file(w, out / "model.safetensors")
    return out


def test_export_layout(target, tmp_path):
    d = make_dflash(target)
    out = export_drafter(d, tmp_path / "x", meta={"target": target.fingerprint})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": MASK, "causal": False,
                                    "block_size": 4}                      # HF aux ids (1, 2, 3) - 1
    assert cfg["is_causal"] is False and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8 and cfg["num_hidden_layers"] == 2
    assert cfg["vocab_size"] == 256 and cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] >= target.config.max_position_embeddings
    assert not any(k.startswith("eagle") for k in cfg) and cfg["eyas_target"] == target.fingerprint
    w = load_file(out / "model.safetensors")
    assert set(w) == set(d.state_dict()) and all(v.dtype == torch.bfloat16 for v in w.values())
    assert not (out / "mask_embedding.pt").exists()
    readme = (out / "README.md").read_text()
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path" in readme
    assert "--speculative-num-draft-tokens 4" in readme
    assert '"method": "dflash"' in readme and '"num_speculative_tokens": 3' in readme and "FLASH_ATTN" in readme


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip(target, tmp_path, dtype):
    d = make_dflash(target)
    out = export_drafter(d, tmp_path / dtype, meta={"target": target.fingerprint}, dtype=dtype)
    back, meta = open_drafter(out, target=target, kind="dflash")
    assert isinstance(back, DFlashDrafter) and back.config == d.config
    assert meta["format"] == "dflash" and meta["warnings"] == [] and meta["target"] == target.fingerprint
    ref, got = d.state_dict(), back.state_dict()
    assert set(ref) == set(got)
    for k in ref:
        want = ref[k] if dtype == "fp32" else ref[k].bfloat16().float()
        assert got[k].dtype == torch.float32 and torch.equal(got[k], want), k
    assert back.mask_embedding is None


def test_run_dir_exports_and_reexports(target, tmp_path):
    d = make_dflash(target)
    save_drafter(d, tmp_path / "run" / "drafter", meta={"target": target.fingerprint})
    out = run_export(tmp_path / "run", tmp_path / "exp", dtype="fp32")
    again = run_export(out, tmp_path / "exp2", dtype="fp32")          # an export opens like any drafter
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (again / name).read_bytes(), name
    other = target_from_model(make_tiny_llama(layers=8, seed=5, rope_theta=5e5), name="tiny")
    with pytest.raises(EyasError, match="target"):
        open_drafter(out, target=other)
    back, meta = open_drafter(out, target=other, allow_target_mismatch=True)
    assert "target_mismatch" in meta and "target" not in meta


@pytest.mark.parametrize("aux,match", [
    ((2, 5, 8), r"include 7, the target's last layer"),                  # HF 8 = after layer 7 = N-1
    ((3, 2, 5), "not strictly ascending"),
])
def test_export_refuses_unservable(target, tmp_path, aux, match):
    d = make_dflash(target, aux=aux)
    with pytest.raises(EyasError, match=match):
        export_drafter(d, tmp_path / "x")
    assert not (tmp_path / "x").exists()                                  # nothing written


def test_export_refuses_own_mask_row(target, tmp_path):
    d = make_dflash(target)
    d.set_mask_embedding(torch.ones(64))
    with pytest.raises(EyasError, match="mask embedding"):
        export_drafter(d, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_kind_is_checked(target, tmp_path):
    df = export_drafter(make_dflash(target), tmp_path / "df")
    eg = export_drafter(eagle3_for_target(target), tmp_path / "eg")
    save_drafter(make_dflash(target), tmp_path / "own")
    with pytest.raises(EyasError, match="a DFlash drafter where an EAGLE-3 drafter was expected"):
        open_drafter(df, kind="eagle3")
    with pytest.raises(EyasError, match="a DFlash drafter where an EAGLE-3 drafter was expected"):
        open_drafter(tmp_path / "own", kind="eagle3")
    with pytest.raises(EyasError, match="an EAGLE-3 drafter where a DFlash drafter was expected"):
        open_drafter(eg, kind="dflash")
    with pytest.raises(EyasError, match="not a DFlash drafter"):
        load_dflash_checkpoint(eg)
    assert open_drafter(eg, kind="eagle3")[1]["format"] == "eagle3"


def test_mask_embedding_sidecar(target, tmp_path):
    out = export_drafter(make_dflash(target), tmp_path / "x", dtype="fp32")
    row = torch.randn(64)
    torch.save({"embedding": row, "mask_token_id": MASK}, out / "mask_embedding.pt")
    back, _ = load_dflash_checkpoint(out)
    assert torch.equal(back.mask_embedding, row)
    emb = torch.randn(256, 64)
    ids = torch.tensor([[3, MASK, MASK]])
    got = back.embed_block(ids, emb)
    assert torch.equal(got[0, 0], emb[3]) and torch.equal(got[0, 1], row) and torch.equal(got[0, 2], row)


def test_published_names(target, tmp_path):
    """`model.` prefixes, the engines' `encoder.` aliases and a sharded index; embed_tokens dropped with a warning."""
    d = make_dflash(target)
    out = export_drafter(d, tmp_path / "x", dtype="fp32")
    w = load_file(out / "model.safetensors")
    w = {("encoder.fc.weight" if k == "fc.weight" else f"model.{k}"): v for k, v in w.items()}
    w["model.embed_tokens.weight"] = torch.zeros(256, 64)
    names = sorted(w)
    save_file({k: w[k] for k in names[:5]}, out / "a.safetensors")
    save_file({k: w[k] for k in names[5:]}, out / "b.safetensors")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: ("a.safetensors" if i < 5 else "b.safetensors") for i, k in enumerate(names)}}))
    back, meta = load_dflash_checkpoint(out)
    assert any("embed_tokens" in m for m in meta["warnings"])
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def _bad_mask_file(out):
    torch.save(torch.zeros(64), out / "mask_embedding.pt")            # a bare tensor, not the dict


@pytest.mark.parametrize("case,match", [
    ("mask_range", r"mask_token_id 300 is outside the target's vocabulary"),
    ("block_big", "block_size must be 2 to 32"),
    ("block_small", "block_size must be 2 to 32"),
    ("unknown_key", r"dflash_config key 'frobnicate' is unknown"),
    ("causal", r"dflash_config.causal = True changes the drafter's math"),
    ("is_causal", r"is_causal = True changes the drafter's math"),
    ("swa", r"dflash_config.use_swa = True"),
    ("no_mask", "mask_token_id must be an int"),
    ("sliding", "sliding-window layers"),
    ("missing", r"missing \['layers.1.mlp.up_proj.weight'\]"),
    ("extra", r"unexpected \['layers.0.foo.weight'\]"),
    ("shape", r"wrong shape \['fc.weight \(64, 128\)"),
    ("mask_tensor", r"mask_embedding.pt: expected a dict with a tensor 'embedding' of shape \(64,\), got Tensor"),
    ("mask_shape", r"embedding is torch.float32 \(32,\)"),
    ("mask_id", r"mask_token_id 8 != config.json's 7"),
])
def test_bad_checkpoints(target, tmp_path, case, match):
    out = export_drafter(make_dflash(target), tmp_path / "x")
    dc = lambda **kw: (lambda c: c["dflash_config"].update(kw))   # noqa: E731
    edits = {
        "mask_range": dict(cfg_edit=dc(mask_token_id=300)),
        "block_big": dict(cfg_edit=lambda c: (c.update(block_size=33), c["dflash_config"].update(block_size=33))),
        "block_small": dict(cfg_edit=lambda c: (c.update(block_size=1), c["dflash_config"].update(block_size=1))),
        "unknown_key": dict(cfg_edit=dc(frobnicate=1)),
        "causal": dict(cfg_edit=dc(causal=True)),
        "is_causal": dict(cfg_edit=lambda c: c.update(is_causal=True)),
        "swa": dict(cfg_edit=dc(use_swa=True, swa_window_size=8)),
        "no_mask": dict(cfg_edit=lambda c: c["dflash_config"].pop("mask_token_id")),
        "sliding": dict(cfg_edit=lambda c: c.update(layer_types=["sliding_attention", "full_attention"])),
        "missing": dict(w_edit=lambda w: w.pop("layers.1.mlp.up_proj.weight")),
        "extra": dict(w_edit=lambda w: w.update({"layers.0.foo.weight": torch.zeros(3)})),
        "shape": dict(w_edit=lambda w: w.update({"fc.weight": torch.zeros(64, 128)})),
    }
    _edit(out, **edits.get(case, {}))
    if case == "mask_tensor":
        _bad_mask_file(out)
    elif case == "mask_shape":
        torch.save({"embedding": torch.zeros(32), "mask_token_id": MASK}, out / "mask_embedding.pt")
    elif case == "mask_id":
        torch.save({"embedding": torch.zeros(64), "mask_token_id": MASK + 1}, out / "mask_embedding.pt")
    with pytest.raises(EyasError, match=match) as e:
        open_drafter(out, target=target)
    assert "\n" not in str(e.value)
