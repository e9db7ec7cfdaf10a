"""Targets that are never loaded whole: a DeepSeek-V3 twin's weightless directory (config,
tokenizer, index, the head's shard) opens like the full checkpoint with the same fingerprint, goes through prepare,
offline train and export without its model being built, and every bad input is one line and exit code 2."""

import builtins
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.deepseek_twin import HEAD_TENSORS, save_twin, weightless_copy
from test_prepare import write_data
from test_stage_start import TARGET_LINE

from eyas.cli import main
from eyas.target import load_target
from eyas.target.fingerprint import HEAD_FORMAT, config_fields, diffs
from eyas.target.load import weights_of
from eyas.target.meta import JsonConfig, open_target_meta

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(full twin dir, its weightless copy), with a private hash cache."""
    root = tmp_path_factory.mktemp("weightless")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EYAS_CACHE", str(root / "cache"))
        full = save_twin(root / "twin")
        yield full, weightless_copy(full, root / "twin-weightless")


@pytest.fixture(autouse=True)
def _cache(dirs, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(dirs[0].parent / "cache"))


def no_model_built(monkeypatch):
    """Make building any HF model fail, so a stage that loads the target whole cannot pass."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("the target's model was built")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def same_target(a: dict, b: dict) -> None:
    assert diffs(a, b) == [] and {k: v for k, v in a.items() if k != "identity"} == \
        {k: v for k, v in b.items() if k != "identity"}


def test_meta_of_full_and_weightless_dirs_is_the_loaded_target(dirs):
    full, wl = dirs
    target = load_target(str(full))
    a, b = open_target_meta(str(full)), open_target_meta(str(wl))
    assert a.model is None and b.model is None
    same_target(a.fingerprint, target.fingerprint)
    same_target(b.fingerprint, target.fingerprint)
    assert target.fingerprint["weights"]["format"] == HEAD_FORMAT
    for m in (a, b):
        assert (m.num_layers, m.hidden_size, m.vocab_size, m.tie_word_embeddings, m.aux_layer_ids, m.eos_token_ids) == \
            (target.num_layers, target.hidden_size, target.vocab_size, target.tie_word_embeddings,
             target.aux_layer_ids, target.eos_token_ids)
        assert config_fields(m.config) == config_fields(target.config)
        for k in ("embed_tokens", "lm_head", "final_norm"):
            w, ref = getattr(m, k).weight, getattr(target, k).weight
            assert w.dtype == ref.dtype and torch.equal(w, ref)   # bitwise
    # lazily: nothing read until a stage touches .weight
    assert open_target_meta(str(wl)).lm_head._weight is None


def test_the_fingerprint_opens_only_the_head_shards(dirs, monkeypatch, tmp_path):
    full, _ = dirs
    index = json.loads((full / INDEX).read_text())["weight_map"]
    head_shards = {index[n] for n in HEAD_TENSORS}
    assert len(set(index.values()) - head_shards) >= 5   # the layers live in other shards
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cold"))   # nothing hashed yet
    opened, real_open = [], builtins.open

    def spy(file, *a, **k):
        opened.append(Path(str(file)).name)
        return real_open(file, *a, **k)
    monkeypatch.setattr(builtins, "open", spy)
    w = weights_of(str(full))
    meta = open_target_meta(str(full))
    monkeypatch.setattr(builtins, "open", real_open)
    shards = {n for n in opened if n.endswith(".safetensors")}
    assert shards == head_shards
    assert w == meta.fingerprint["weights"]
    # the other shards' bytes do not count: garbage there gives the same identity
    copy = shutil.copytree(full, tmp_path / "garbage")
    for name in set(index.values()) - head_shards:
        (copy / name).write_bytes(b"\0" * 64)
    assert weights_of(str(copy)) == w


def test_raw_json_config_fields_equal_the_transformers_config():
    """A model type transformers does not know is read as JSON: its fields (YaRN rope in the 4.x spelling, MLA
    head_dim, the experts alias) come out as transformers' own class reads the same JSON."""
    from transformers import DeepseekV3Config

    kimi_k2 = {  # Kimi-K2's public config.json fields (moonshotai/Kimi-K2-Instruct)
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585}
    raw = config_fields(JsonConfig(kimi_k2))
    hf = config_fields(DeepseekV3Config.from_dict({**kimi_k2, "model_type": "deepseek_v3"}))
    assert {**raw, "model_type": "deepseek_v3"} == hf
    assert raw["head_dim"] == 64 and raw["rope_scaling"]["rope_type"] == "yarn" and "type" not in raw["rope_scaling"]


def kimi_wrapped(wl: Path, out: Path, model_type: str = "kimi_k25") -> Path:
    """The weightless twin as Kimi-K2.5 lays it out: a VLM wrapper config (model type transformers does not know)
    with the LM under text_config, the head tensors under language_model.*, an index naming vision shards that are
    absent (no stage needs them)."""
    out.mkdir()
    for p in wl.iterdir():
        if not p.name.endswith(".safetensors") and p.name not in (INDEX, "config.json"):
            shutil.copy2(p, out / p.name)
    index = json.loads((wl / INDEX).read_text())["weight_map"]
    tensors = {}
    for n in HEAD_TENSORS:
        tensors["language_model." + n] = load_file(wl / index[n])[n]
    save_file(tensors, out / "model-head.safetensors")
    wm = {k: "model-head.safetensors" for k in tensors}
    wm.update({"vision_tower.blocks.0.weight": "model-vision.safetensors",
               "language_model.model.layers.0.mlp.gate_proj.weight": "model-00002.safetensors"})
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    text = json.loads((wl / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    (out / "config.json").write_text(json.dumps({"model_type": model_type, "architectures":
                                                 ["KimiK25ForConditionalGeneration"], "text_config": text,
                                                 "vision_config": {"hidden_size": 16}}))
    return out


@pytest.mark.parametrize("model_type", ["kimi_k25", "vlm_unknown_to_transformers"])
def test_a_vlm_wrapped_target_opens_from_its_text_config(dirs, tmp_path, model_type):
    """kimi_k25: transformers' own KimiK25Config where this version has it (5.24; 5.17 lacks it), else the JSON."""
    from transformers import CONFIG_MAPPING

    full, wl = dirs
    target = load_target(str(full))
    meta = open_target_meta(str(kimi_wrapped(wl, tmp_path / "kimi", model_type)))
    assert isinstance(meta.config, JsonConfig) == (model_type not in CONFIG_MAPPING)   # no code from the dir
    fields = config_fields(meta.config)
    assert fields.pop("model_type") in ("kimi_k2", "deepseek_v3")
    assert fields == {k: v for k, v in config_fields(target.config).items() if k != "model_type"}
    assert meta.num_layers == target.num_layers and meta.vocab_size == target.vocab_size
    for k in ("embed_tokens", "lm_head", "final_norm"):
        assert torch.equal(getattr(meta, k).weight, getattr(target, k).weight)
    assert meta.fingerprint["tokenizer_sha256"] == target.fingerprint["tokenizer_sha256"]


@pytest.fixture(scope="module")
def pipeline(dirs, tmp_path_factory):
    """prepare (weightless, CLI) -> capture (full, in process) -> offline train (weightless, CLI) -> export
    (weightless, CLI), with no model built in the weightless stages."""
    from eyas.capture.capture import CaptureConfig, run_capture

    full, wl = dirs
    root = tmp_path_factory.mktemp("pipeline")
    data = write_data(root / "d.jsonl", 24)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EYAS_CACHE", str(full.parent / "cache"))
        no_model_built(mp)
        assert main(["prepare", "--target", str(wl), "--data", str(data), "--out", str(root / "prep"),
                     "--max-len", "64"]) == 0
        mp.undo()
        mp.setenv("EYAS_CACHE", str(full.parent / "cache"))
        run_capture(CaptureConfig(target=str(full), data=str(root / "prep"), out=str(root / "store"), progress=False))
        no_model_built(mp)
        assert main(["train", "--store", str(root / "store"), "--target", str(wl), "--out", str(root / "run"),
                     "--steps", "2", "--batch-tokens", "128", "--max-len", "64", "--ttt-steps", "2",
                     "--draft-vocab", "64", "--eval-fraction", "0.2", "--no-progress", "--device", "cpu",
                     "--init-from-target"]) == 0
        assert main(["export", "--drafter", str(root / "run"), "--target", str(wl), "--out", str(root / "export")]) \
            == 0
    return root


def test_weightless_dir_through_prepare_train_and_export(dirs, pipeline):
    root = pipeline
    target = load_target(str(dirs[0]))
    recorded = {
        "prepared": json.loads((root / "prep" / "manifest.json").read_text())["target"],
        "store": json.loads((root / "store" / "manifest.json").read_text())["target"],
        "run": json.loads((root / "run" / "manifest.json").read_text())["target"],
        "export": json.loads((root / "export" / "config.json").read_text())["eyas_target"]}
    for where, fp in recorded.items():
        assert diffs(fp, target.fingerprint) == [], where
        assert fp["weights"] == target.fingerprint["weights"], where
    assert recorded["prepared"]["identity"] == "twin-weightless" and recorded["store"]["identity"] == "twin"
    # --init-from-target started the drafter's norm from the target's final norm, read from the head shard
    run = json.loads((root / "run" / "manifest.json").read_text())
    assert run["source"]["store"].endswith("store")


def fail(argv, capsys) -> str:
    """Run the CLI expecting exit 2 and one line on stderr; return that line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not TARGET_LINE.fullmatch(x)]
    assert len(err) == 1, err
    return err[0]


def written(out: Path) -> list[Path]:
    """The files a refused stage left in its --out (hidden ones too: a refusal leaves no lock file either)."""
    return [p for p in out.rglob("*") if p.is_file()] if out.exists() else []


def bad_copy(wl: Path, tmp: Path, name: str) -> Path:
    return Path(shutil.copytree(wl, tmp / name))


def test_bad_targets_are_one_line_and_write_nothing(dirs, pipeline, tmp_path, capsys):
    _, wl = dirs
    index = json.loads((wl / INDEX).read_text())
    shard = index["weight_map"]["lm_head.weight"]

    def train(target: Path) -> list[str]:
        return ["train", "--store", str(pipeline / "store"), "--target", str(target), "--out",
                str(tmp_path / f"run-{target.name}"), "--steps", "1", "--no-progress", "--device", "cpu",
                "--ttt-steps", "2", "--draft-vocab", "64"]

    norm_shard = index["weight_map"]["model.norm.weight"]
    assert norm_shard != shard
    # the index names a shard that is absent
    gone = bad_copy(wl, tmp_path, "gone")
    (gone / norm_shard).unlink()
    line = fail(train(gone), capsys)
    assert f"{INDEX}: model.norm.weight is in {norm_shard}, which is missing" in line
    # the index places the tensor in a shard that lacks it
    moved = bad_copy(wl, tmp_path, "moved")
    (moved / INDEX).write_text(json.dumps({"weight_map": dict(index["weight_map"], **{"lm_head.weight": norm_shard})}))
    line = fail(train(moved), capsys)
    assert f"{norm_shard}: lacks lm_head.weight, which {INDEX} places there" in line
    # the tensor is not in the index at all
    absent = bad_copy(wl, tmp_path, "absent")
    (absent / INDEX).write_text(json.dumps({"weight_map": {k: v for k, v in index["weight_map"].items()
                                                           if k != "lm_head.weight"}}))
    assert "no lm_head tensor (lm_head.weight" in fail(train(absent), capsys)
    # a quantized head: int8 with a scale beside it, or fp8
    for qname, make in (("int8", lambda w: {"lm_head.weight": w.to(torch.int8), "lm_head.weight_scale":
                                            torch.ones(w.shape[0])}),
                        ("fp8", lambda w: {"lm_head.weight": w.to(torch.float8_e4m3fn)})):
        q = bad_copy(wl, tmp_path, qname)
        tensors = load_file(q / shard)
        tensors.update(make(tensors["lm_head.weight"]))
        save_file(tensors, q / shard)
        (q / INDEX).write_text(json.dumps({"weight_map": {**index["weight_map"],
                                                          **{k: shard for k in tensors}}}))
        line = fail(train(q), capsys)
        assert "lm_head.weight is quantized" in line and "bf16, fp16 or fp32" in line
    for name in ("gone", "moved", "absent", "int8", "fp8"):
        assert not (tmp_path / f"run-{name}").exists(), name


def test_remote_code_needs_the_flag_in_every_stage(dirs, pipeline, tmp_path, capsys, monkeypatch):
    _, wl = dirs
    remote = bad_copy(wl, tmp_path, "remote")
    cfg = json.loads((remote / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (remote / "tokenizer_config.json").write_text(json.dumps(cfg))
    (remote / "tokenization_kimi.py").write_text("raise SystemExit('remote code ran')\n")
    data = write_data(tmp_path / "d.jsonl", 4)
    out = tmp_path / "out"
    commands = {
        "prepare": ["prepare", "--target", str(remote), "--data", str(data), "--out", str(out)],
        "train": ["train", "--store", str(pipeline / "store"), "--target", str(remote), "--out", str(out),
                  "--steps", "1", "--device", "cpu", "--ttt-steps", "2", "--draft-vocab", "64"],
        "export": ["export", "--drafter", str(pipeline / "run"), "--target", str(remote), "--out", str(out)],
        "capture": ["capture", "--target", str(remote), "--data", str(pipeline / "prep"), "--out", str(out)],
        "crosscheck": ["engine", "crosscheck", "--store", str(pipeline / "store"), "--target", str(remote)]}
    for name, argv in commands.items():
        line = fail(argv, capsys)
        assert "needs its own code (tokenizer_config.json auto_map.AutoTokenizer" in line and \
            "tokenization_kimi.py" in line and "--trust-remote-code" in line, name
        assert not out.exists(), (name, written(out))
    # with the flag, the stages ask transformers for the remote tokenizer (here a stand-in that records it)
    from transformers import AutoTokenizer

    asked, real = [], AutoTokenizer.from_pretrained

    def record(path, *a, **k):
        asked.append(k.get("trust_remote_code"))
        return real(str(wl), *a, **{**k, "trust_remote_code": False})
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", record)
    assert main(commands["prepare"] + ["--trust-remote-code", "--max-len", "64"]) == 0
    assert main(commands["export"] + ["--trust-remote-code"]) == 0
    assert asked == [True, True]


def test_weightless_dir_through_dflash_train_and_export(dirs, pipeline, monkeypatch):
    """The DeepSeek-V3 twin's weightless directory trains a DFlash drafter from the same store and exports it, with
    no model built: the block size is the MoE default (8), the context layers are the store's aux ids minus one,
    and the export's config is what both engines read."""
    root = pipeline
    full, wl = dirs
    no_model_built(monkeypatch)
    assert main(["train", "--method", "dflash", "--store", str(root / "store"), "--target", str(wl), "--out",
                 str(root / "dflash"), "--steps", "2", "--batch-tokens", "128", "--max-len", "64", "--anchors", "16",
                 "--eval-fraction", "0.2", "--no-progress", "--device", "cpu"]) == 0
    assert main(["export", "--drafter", str(root / "dflash"), "--target", str(wl), "--out",
                 str(root / "dflash-export")]) == 0
    aux = json.loads((root / "dflash" / "manifest.json").read_text())["source"]["aux_layer_ids"]
    conf = json.loads((root / "dflash-export" / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["block_size"] == 8
    assert conf["dflash_config"]["target_layer_ids"] == [a - 1 for a in aux]
    assert conf["dflash_config"]["causal"] is False and conf["is_causal"] is False
    assert diffs(conf["eyas_target"], json.loads((root / "store" / "manifest.json").read_text())["target"]) == []
    tensors = load_file(str(root / "dflash-export" / "model.safetensors"))
    assert tensors["fc.weight"].shape == (conf["hidden_size"], 3 * conf["hidden_size"])
    assert not any("embed" in k or "lm_head" in k for k in tensors)
