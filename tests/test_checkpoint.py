"""One drafter opener (model/checkpoint.open_drafter): every accepted layout opens to the same weights, bit for
bit; the target fingerprint is checked; anything else is refused in one line (tiny random target, CPU, seconds)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.models import make_tiny_llama
from support.drafters import eagle3_for_target
from eyas.errors import EyasError
from eyas.export.export import export_drafter, run_export
from eyas.model.checkpoint import load_drafter, open_drafter, save_drafter
from eyas.target import target_from_model


@pytest.fixture
def target():
    return target_from_model(make_tiny_llama(layers=8), name="tiny")


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.config == b.config


def published(export_dir, out):
    """An eyas export rewritten the way published heads come: `model.layers.0.*` names, no t2d, SGLang-only
    layer ids, architecture LlamaForCausalLM, no eyas fingerprint."""
    out.mkdir()
    w = load_file(export_dir / "model.safetensors")
    w = {("model." + k.replace("midlayer.", "layers.0.")): v for k, v in w.items() if k != "t2d"}
    save_file(w, out / "model.safetensors")
    cfg = json.loads((export_dir / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"], cfg["eyas_target"]
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture
def layouts(target, tmp_path):
    """The same drafter in each accepted layout."""
    d = eagle3_for_target(target)
    fp = {"target": target.fingerprint}
    save_drafter(d, tmp_path / "RUN" / "train" / "drafter", meta=fp)       # `eyas run` dir
    save_drafter(d, tmp_path / "TRAIN" / "drafter", meta=fp)               # `eyas train` dir
    save_drafter(d, tmp_path / "DIR", meta=fp)                             # save_drafter's dir itself
    export_drafter(d, tmp_path / "EXPORT", meta=fp, dtype="fp32")          # `eyas export`
    published(tmp_path / "EXPORT", tmp_path / "HEAD")                      # a published EAGLE-3 head
    return d, tmp_path


@pytest.mark.parametrize("name,fmt,found", [("RUN", "eyas", "RUN/train/drafter"), ("TRAIN", "eyas", "TRAIN/drafter"),
                                            ("DIR", "eyas", "DIR"), ("EXPORT", "eagle3", "EXPORT"),
                                            ("HEAD", "eagle3", "HEAD")])
def test_every_layout_opens_to_the_same_drafter(target, layouts, name, fmt, found):
    d, root = layouts
    got, meta = open_drafter(root / name, target)
    same_weights(d, got)
    assert meta["format"] == fmt and meta["source"] == str(root / found)
    assert meta["aux_layer_ids"] == list(target.aux_layer_ids)
    assert meta.get("target") == (None if name == "HEAD" else target.fingerprint)   # the head records none
    got_plain, _ = open_drafter(root / name)      # without a target: nothing to check, same weights
    same_weights(d, got_plain)


@pytest.mark.parametrize("name", ["RUN", "TRAIN", "DIR", "EXPORT"])
def test_target_checked_once_naming_the_field(layouts, name):
    _, root = layouts
    other = target_from_model(make_tiny_llama(layers=8, seed=5, rope_theta=5e5), name="tiny")
    with pytest.raises(EyasError, match=r"does not match \(.*rope.*--allow-target-mismatch"):
        open_drafter(root / name, other)
    _, meta = open_drafter(root / name, other, allow_target_mismatch=True)
    assert "target" not in meta and meta["trained_target"]["identity"] == "tiny"
    assert "rope" in meta["target_mismatch"] and meta["target_mismatch"] in meta["warnings"]


@pytest.mark.parametrize("make", ["missing", "empty", "other-files", "nested-empty"])
def test_not_a_drafter_is_one_clear_line(tmp_path, make):
    p = tmp_path / "x"
    if make != "missing":
        p.mkdir()
    if make == "other-files":
        (p / "notes.txt").write_text("hi")
        (p / "model.safetensors").write_bytes(b"")
    if make == "nested-empty":
        (p / "train" / "drafter").mkdir(parents=True)
    with pytest.raises(EyasError) as e:
        open_drafter(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: not a drafter")
    assert all(w in msg for w in ("run dir", "drafter dir", "EAGLE-3"))


def test_save_load_moved_with_meta(target, tmp_path):
    d = eagle3_for_target(target)
    save_drafter(d, tmp_path / "d", meta={"target": target.fingerprint, "note": 1})
    back, meta = load_drafter(tmp_path / "d")
    same_weights(d, back)
    assert meta == {"target": target.fingerprint, "note": 1}
    import eyas.model.drafter as drafter_module
    assert not hasattr(drafter_module, "save_drafter") and not hasattr(drafter_module, "load_drafter")


def test_export_reexports_a_published_head_and_a_run_dir(target, layouts):
    """`eyas export` opens --drafter with open_drafter: a published head (which it refused before) and an
    `eyas run` dir both export to the same weights."""
    d, root = layouts
    a = run_export(root / "HEAD", root / "from-head", dtype="fp32")
    b = run_export(root / "RUN", root / "from-run", dtype="fp32")
    for out in (a, b):
        got, _ = open_drafter(out, target)
        same_weights(d, got)
    assert load_file(a / "model.safetensors").keys() == load_file(b / "model.safetensors").keys()


def test_bench_help_names_the_run_dir():
    import argparse

    from eyas.bench.command import register

    sub = argparse.ArgumentParser().add_subparsers()
    p = register(sub)
    help_text = " ".join(p.format_help().split())
    assert "eyas run dir (RUN/, e.g. runs/cpu-demo)" in help_text


def test_bench_opens_an_eyas_run_dir(tmp_path):
    """`eyas bench --drafter RUN` (an `eyas run` dir, e.g. runs/cpu-demo) benches RUN/train/drafter: the same
    report as the drafter passed in."""
    from support.models import byte_tokenizer
    from eyas.bench.bench import BenchConfig, run_bench
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    model = make_tiny_llama(vocab=258, seed=31)
    model.config.eos_token_id = model.generation_config.eos_token_id = 257
    target = target_from_model(model, byte_tokenizer(), name="tiny", aux_layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=258, aux_layer_ids=(1, 2, 3)))
    save_drafter(drafter, tmp_path / "RUN" / "train" / "drafter", meta={"target": target.fingerprint})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["one", "two, again"]}) + "\n")
    kw = dict(prompts=str(prompts), k=3, max_new_tokens=8, max_seq=160, baselines=False, lossless_turns=0)
    by_dir = run_bench(BenchConfig(drafter=str(tmp_path / "RUN"), **kw), target=target)
    direct = run_bench(BenchConfig(**kw), target=target, drafter=drafter.eval())
    a, b = by_dir["methods"]["eagle-chain"], direct["methods"]["eagle-chain"]
    assert a["tokens"] == b["tokens"] and a["tau"] == b["tau"] and a["acceptance_by_position"] == b["acceptance_by_position"]
