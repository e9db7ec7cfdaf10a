"""Portable target fingerprints (target/fingerprint.py): the same target under another path or name, or converted by
another transformers version, is the same target; a different config field, vocabulary, special token or weights
file is refused naming the field; a fingerprint of an older version is refused in one line; --allow-target-mismatch
overrides with a recorded warning."""

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from support.models import make_tiny_llama
from support.models import byte_tokenizer
from eyas.capture.capture import CaptureConfig, run_capture
from eyas.errors import EyasError
from eyas.manifest import check_target, diff_dicts
from eyas.model.checkpoint import open_drafter
from eyas.target import load_target
from eyas.target.fingerprint import VERSION, config_fields, diffs, file_sha256, fingerprint, tokenizer_sha256
from eyas.train.config import TrainConfig
from eyas.train.trainer import run_train

V = 258


def save_target(path, *, seed=31, **kw):
    model = make_tiny_llama(vocab=V, seed=seed, **kw)
    model.config.eos_token_id = 257
    model.generation_config.eos_token_id = 257
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def swapped_tokenizer():
    """The byte tokenizer with the ids of 'a' and 'b' swapped: the same tokens, another vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    vocab.update({"<|im_start|>": 256, "<|im_end|>": 257})
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", bos_token="<|im_start|>")


def samples(n=16):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        L = int(torch.randint(8, 24, (1,), generator=g))
        out.append((f"s{i}", torch.randint(0, 256, (L,), generator=g).tolist(), [0] * (L // 3) + [1] * (L - L // 3)))
    return out


@pytest.fixture(scope="module")
def machine_a(tmp_path_factory):
    """'Machine A': the target saved under one path and name; a store captured and a drafter trained on it."""
    root = tmp_path_factory.mktemp("machine-a")
    target = load_target(str(save_target(root / "tiny-original")))
    run_capture(CaptureConfig(out=str(root / "store"), progress=False), target, samples=samples())
    run_train(TrainConfig(out=str(root / "run"), store=str(root / "store"), steps=3, batch_tokens=96, draft_vocab=64,
                          ttt_steps=2, eval_fraction=0.2, progress=False, deterministic=True), target=target)
    return root, target


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """'Machine B': its own cache, and a byte-for-byte copy of the target under another path and name."""
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache-b"))
    return tmp_path


def prompts(path):
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ("hello there", "abcabcabc")) + "\n")
    return str(path)


def test_same_content_under_another_path_is_the_same_target(machine_a, elsewhere):
    from eyas.bench.bench import BenchConfig, run_bench
    from eyas.store.reader import Store

    root, target_a = machine_a
    copy = shutil.copytree(root / "tiny-original", elsewhere / "models" / "renamed-copy")
    target_b = load_target(str(copy))
    assert target_b.fingerprint["identity"] != target_a.fingerprint["identity"]
    assert target_b.fingerprint["weights"] == target_a.fingerprint["weights"] and target_b.fingerprint["weights"]
    # the drafter, the store and a bench of the drafter all accept the copy
    drafter, meta = open_drafter(root / "run", target=target_b)
    assert meta["target"]["identity"] == "tiny-original" and "target_mismatch" not in meta
    Store(root / "store", target=target_b)
    report = run_bench(BenchConfig(target=str(copy), drafter=str(root / "run"), prompts=prompts(elsewhere / "p.jsonl"),
                                   max_seq=128, max_new_tokens=4, limit=2, device="cpu"), target=target_b)
    assert report["methods"]["eagle-chain"]["tokens"] > 0 and report["lossless"]["eagle-chain"]["held"]
    # so does training on: --init from the drafter, offline from machine A's store
    run_train(TrainConfig(out=str(elsewhere / "run2"), store=str(root / "store"), init=str(root / "run"), steps=2,
                          batch_tokens=96, draft_vocab=64, ttt_steps=2, eval_fraction=0.2, progress=False,
                          deterministic=True), target=target_b)


def test_a_different_config_field_is_refused_by_name(machine_a, elsewhere):
    from eyas.bench.bench import BenchConfig, run_bench

    root, _ = machine_a
    other = shutil.copytree(root / "tiny-original", elsewhere / "eps")
    raw = json.loads((other / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(raw))
    target = load_target(str(other))
    with pytest.raises(EyasError, match=r"run/drafter/config.json: target does not match \(config.rms_norm_eps: "
                                        r"1e-05 != 1e-06\); --allow-target-mismatch"):
        open_drafter(root / "run", target=target)
    with pytest.raises(EyasError, match=r"config.rms_norm_eps"):
        run_bench(BenchConfig(target=str(other), drafter=str(root / "run"), prompts=prompts(elsewhere / "p.jsonl"),
                              max_seq=128, max_new_tokens=4, limit=1, device="cpu"), target=target)
    # the override loads it and keeps the warning
    _, meta = open_drafter(root / "run", target=target, allow_target_mismatch=True)
    assert "config.rms_norm_eps" in meta["target_mismatch"] and "target" not in meta
    assert meta["trained_target"]["identity"] == "tiny-original"


def test_other_weights_or_tokenizer_refused(machine_a, elsewhere):
    from eyas.store.reader import Store

    root, target_a = machine_a
    reseeded = load_target(str(save_target(elsewhere / "reseeded", seed=5)))
    with pytest.raises(EyasError, match=r"target does not match \(weights.sha256 \(safetensors-head\): "
                                        r"'[0-9a-f]{12}\.\.\.' "
                                        r"!= '[0-9a-f]{12}\.\.\.'\)"):
        Store(root / "store", target=reseeded)
    retok = shutil.copytree(root / "tiny-original", elsewhere / "retok")
    swapped_tokenizer().save_pretrained(retok)
    with pytest.raises(EyasError, match=r"target does not match \(tokenizer_sha256: '[0-9a-f]{12}\.\.\.' != "):
        Store(root / "store", target=load_target(str(retok)))
    eos = shutil.copytree(root / "tiny-original", elsewhere / "eos")
    raw = json.loads((eos / "config.json").read_text())
    raw["eos_token_id"] = 256
    (eos / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EyasError, match=r"target does not match \(special_tokens.eos: \[256\] != \[257\]\)"):
        Store(root / "store", target=load_target(str(eos)))
    assert diff_dicts(target_a.fingerprint, dict(target_a.fingerprint, weights=None)) == []   # unhashed: not compared


def test_bench_cli_override_is_recorded_in_the_json(machine_a, elsewhere):
    from eyas.cli import main

    root, _ = machine_a
    other = shutil.copytree(root / "tiny-original", elsewhere / "theta")
    raw = json.loads((other / "config.json").read_text())
    raw["rope_parameters"]["rope_theta"] = 5e5
    (other / "config.json").write_text(json.dumps(raw))
    args = ["bench", "--target", str(other), "--drafter", str(root / "run"), "--prompts", prompts(elsewhere / "p.jsonl"),
            "--max-seq", "128", "--max-new-tokens", "4", "--limit", "1", "--device", "cpu", "--no-baselines",
            "--json", str(elsewhere / "b.json")]
    assert main(args) == 2   # refused: one line, exit code 2
    assert main(args + ["--allow-target-mismatch"]) == 0
    rep = json.loads((elsewhere / "b.json").read_text())
    assert "config.rope_theta: 10000.0 != 500000.0" in rep["target_mismatch"]["warning"]
    assert rep["target_mismatch"]["trained_target"]["identity"] == "tiny-original"


def test_bench_cli_graph_round_reaches_the_report(machine_a, elsewhere):
    """`eyas bench` through main() on a saved target and trained drafter: on the CPU graph rounds are off unless
    --graph-round asks (chains and trees), and the report's config says which ran; with sampling the flag is refused
    in one line (exit 2). The CUDA default (on for greedy chains) is tests/test_bench.py's bench_config test."""
    from eyas.cli import main

    root, _ = machine_a
    base = ["bench", "--target", str(root / "tiny-original"), "--drafter", str(root / "run"), "--prompts",
            prompts(elsewhere / "p.jsonl"), "--max-seq", "128", "--max-new-tokens", "6", "--limit", "2", "--device",
            "cpu", "--no-baselines"]
    ran = {}
    for name, extra in (("default", []), ("chain", ["--graph-round"]), ("tree", ["--tree", "--top-k", "3", "--depth",
                                                                                 "3", "--total-tokens", "8",
                                                                                 "--graph-round"])):
        out = elsewhere / f"{name}.json"
        assert main(base + extra + ["--json", str(out)]) == 0
        ran[name] = json.loads(out.read_text())
    assert [ran[n]["config"]["spec"]["graph_round"] for n in ("default", "chain", "tree")] == [False, True, True]
    assert ran["default"]["methods"]["eagle-chain"]["tokens"] == ran["chain"]["methods"]["eagle-chain"]["tokens"]
    assert main(base + ["--temperature", "0.5", "--graph-round"]) == 2


OLDER = "fingerprint version {v} (recorded by an older eyas; this eyas compares version 3): rerun the stage that wrote it"


def test_fingerprints_of_older_versions_are_refused_in_one_line(machine_a, elsewhere):
    """A version-1 or version-2 fingerprint (an older eyas's) is not compared, even where its fields would match the
    target's: one line says to rerun the stage that wrote it; an export with --allow-target-mismatch converts a
    drafter by recording this version's fingerprint."""
    from eyas.export.export import export_drafter
    from eyas.model.checkpoint import load_drafter, save_drafter

    root, target = machine_a
    fp = target.fingerprint
    v1 = {"identity": "some/other/path", "config_sha256": "0" * 64, "tokenizer_sha256": "1" * 64}
    v2 = {"fingerprint": 2, "identity": "elsewhere/tiny", "config": fp["config"], "tokenizer_sha256": "2" * 64,
          "weights": fp["weights"]}
    for old, v in ((v1, 1), (v2, 2)):
        assert diff_dicts(old, fp) == diff_dicts(fp, old) == [OLDER.format(v=v)]
    drafter, _ = load_drafter(root / "run" / "drafter")
    for name, old, v in (("v1", v1, 1), ("v2", v2, 2)):
        save_drafter(drafter, elsewhere / name / "drafter", meta={"target": old})
        with pytest.raises(EyasError, match=rf"{name}/drafter/config.json: target does not match "
                                            rf"\({re.escape(OLDER.format(v=v))}\); --allow-target-mismatch"):
            open_drafter(elsewhere / name, target=target)
    # converting: an export against the target with the override records this version's fingerprint
    out = export_drafter(drafter, elsewhere / "exported", meta={"target": v1}, target=target,
                         allow_target_mismatch=True)
    assert json.loads((out / "config.json").read_text())["eyas_target"] == fp and fp["fingerprint"] == VERSION
    assert "Warning:" in (out / "README.md").read_text()
    _, meta = open_drafter(out, target=target)
    assert meta["target"] == fp and "target_mismatch" not in meta


def test_config_fields_same_for_both_rope_spellings():
    """transformers 5 spells rope_parameters, 4.x rope_theta + rope_scaling; fp32-stored floats (GGUF) equal."""
    common = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V)
    v5 = SimpleNamespace(**common, rms_norm_eps=1e-5,
                         rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0})
    v4 = SimpleNamespace(**common, rms_norm_eps=9.999999747378752e-06, rope_theta=500000.0,
                         rope_scaling={"type": "llama3", "factor": 8.0})
    assert config_fields(v5) == config_fields(v4)
    assert config_fields(v4)["head_dim"] == 16 and config_fields(v4)["rope_scaling"]["rope_type"] == "llama3"


def test_tokenizer_hash_is_the_vocabulary_not_the_files(tmp_path):
    from transformers import AutoTokenizer

    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path / "t")
    again = AutoTokenizer.from_pretrained(tmp_path / "t")
    assert tokenizer_sha256(again) == tokenizer_sha256(tok)
    again.chat_template = "{{ messages }}"
    assert tokenizer_sha256(again) == tokenizer_sha256(tok)
    again.add_tokens(["<|extra|>"])
    assert tokenizer_sha256(again) != tokenizer_sha256(tok)


def test_file_hash_cached_by_path_size_mtime(tmp_path, monkeypatch):
    import hashlib
    import os

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "w.gguf"
    f.write_bytes(b"a" * 1000)
    assert file_sha256(f) == hashlib.sha256(b"a" * 1000).hexdigest()
    assert len(list((tmp_path / "cache" / "hashes").iterdir())) == 1
    st = f.stat()
    f.write_bytes(b"b" * 1000)                          # same size, same mtime: the cache answers (stale on purpose)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_sha256(f) == hashlib.sha256(b"a" * 1000).hexdigest()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # touched: hashed again
    assert file_sha256(f) == hashlib.sha256(b"b" * 1000).hexdigest()


def test_export_cli_override(machine_a, elsewhere):
    """`eyas export --target T` refuses a drafter trained on another target unless --allow-target-mismatch, and
    then writes the warning into the export's README."""
    from eyas.cli import main

    root, _ = machine_a
    other = shutil.copytree(root / "tiny-original", elsewhere / "theta-x")
    raw = json.loads((other / "config.json").read_text())
    raw["rope_parameters"]["rope_theta"] = 5e5
    (other / "config.json").write_text(json.dumps(raw))
    args = ["export", "--drafter", str(root / "run"), "--out", str(elsewhere / "exp"), "--target", str(other)]
    assert main(args) == 2
    assert main(args + ["--allow-target-mismatch"]) == 0
    assert "config.rope_theta" in (elsewhere / "exp" / "README.md").read_text()


def test_train_override_on_a_store_of_another_target(machine_a, elsewhere):
    root, _ = machine_a
    other = shutil.copytree(root / "tiny-original", elsewhere / "eps-t")
    raw = json.loads((other / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(raw))
    target = load_target(str(other))
    kw = dict(store=str(root / "store"), steps=1, batch_tokens=96, draft_vocab=64, ttt_steps=2, eval_fraction=0.0,
              progress=False, deterministic=True)
    with pytest.raises(EyasError, match=r"config.rms_norm_eps: 1e-05 != 1e-06\); --allow-target-mismatch"):
        run_train(TrainConfig(out=str(elsewhere / "t1"), **kw), target=target)
    run_train(TrainConfig(out=str(elsewhere / "t2"), allow_target_mismatch=True, **kw), target=target)
    manifest = json.loads((elsewhere / "t2" / "manifest.json").read_text())
    assert "config.rms_norm_eps" in manifest["source"]["target_mismatch"]


# What the GPU machine (transformers 5.17.0) recorded for the embedded SmolLM2-135M GGUF with fingerprint version 2:
# the same file as here, byte for byte.
GPU_5_17_FINGERPRINT = {
    "fingerprint": 2, "identity": "gguf:smollm2.gguf",
    "config": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
               "hidden_act": "silu", "rms_norm_eps": 1e-05, "tie_word_embeddings": True, "attention_bias": False,
               "mlp_bias": False, "rope_theta": 100000.0},
    "tokenizer_sha256": "d09447a23ee125070d146a44de49a7de1542beb95e60104664b1da33d17ad922",
    "weights": {"format": "gguf", "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"}}
# The tokenizer_config.json transformers 5.17.0 writes for that GGUF (whose metadata says bos 1, eos 2, unk 0, pad 2):
# its eos is the bos token. 5.24.0 writes eos and pad '<|im_end|>'. tokenizer.json differs only in decoders and BPE
# options (same vocabulary, same encodings).
TOKENIZER_CONFIG_5_17 = {
    "add_prefix_space": False, "backend": "tokenizers", "bos_token": "<|im_start|>", "bos_token_id": 1,
    "clean_up_tokenization_spaces": True, "eos_token": "<|im_start|>", "eos_token_id": 1, "is_local": True,
    "legacy": False, "local_files_only": False, "model_max_length": 1000000000000000019884624838656,
    "model_type": "gpt2", "pad_token_id": None, "tokenizer_class": "TokenizersBackend",
    "unk_token": "<|endoftext|>", "unk_token_id": 0}
TOKENIZER_CONFIG_5_24 = {
    "backend": "tokenizers", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "is_local": True,
    "local_files_only": True, "model_max_length": 1000000000000000019884624838656, "pad_token": "<|im_end|>",
    "tokenizer_class": "TokenizersBackend", "unk_token": "<|endoftext|>"}


def as_converted(tokenizer_json, config: dict, out):
    """A tokenizer directory: these tokenizer.json bytes with the tokenizer_config.json a transformers version wrote."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True)
    shutil.copy(tokenizer_json, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(out)


def byte_level_versions(tmp_path):
    """The byte tokenizer as transformers 5.17 and 5.24 leave a converted GGUF tokenizer: the same vocabulary,
    eos '<|im_start|>' (the bos) or '<|im_end|>'; its config says bos 256, eos 257 (the GGUF's metadata)."""
    byte_tokenizer().save_pretrained(tmp_path / "saved")
    ids = {"bos_token_id": 256, "eos_token_id": 256, "unk_token_id": None}
    v517 = as_converted(tmp_path / "saved" / "tokenizer.json", {**TOKENIZER_CONFIG_5_17, **ids, "unk_token": None},
                        tmp_path / "5.17")
    v524 = as_converted(tmp_path / "saved" / "tokenizer.json", {**TOKENIZER_CONFIG_5_24, "unk_token": None},
                        tmp_path / "5.24")
    config = make_tiny_llama(vocab=V).config
    config.bos_token_id, config.eos_token_id = 256, 257
    return config, v517, v524


def test_tokenizer_identity_is_the_same_under_transformers_5_17_and_5_24(tmp_path):
    config, v517, v524 = byte_level_versions(tmp_path)
    # the real difference: the same vocabulary, the eos string differs
    assert v517.get_vocab() == v524.get_vocab()
    assert (v517.eos_token, v524.eos_token) == ("<|im_start|>", "<|im_end|>")
    # the fingerprint: the vocabulary and the special ids the config declares
    a, b = fingerprint(config, v517, identity="gpu"), fingerprint(config, v524, identity="cpu")
    assert {k: v for k, v in a.items() if k != "identity"} == {k: v for k, v in b.items() if k != "identity"}
    assert a["special_tokens"] == {"bos": [256], "eos": [257]} and diffs(a, b) == [] and diffs(b, a) == []


def test_added_tokens_count_whether_or_not_get_vocab_lists_them():
    tok = byte_tokenizer()
    listed = SimpleNamespace(get_vocab=tok.get_vocab, added_tokens_decoder={})
    unlisted = SimpleNamespace(get_vocab=lambda: {k: v for k, v in tok.get_vocab().items() if v < 256},
                               added_tokens_decoder={256: "<|im_start|>", 257: "<|im_end|>"})
    assert tokenizer_sha256(listed) == tokenizer_sha256(unlisted) == tokenizer_sha256(tok)


def test_the_same_gguf_is_the_same_target_and_another_is_refused_by_field():
    recorded = dict(GPU_5_17_FINGERPRINT, fingerprint=3, special_tokens={"bos": [1], "eos": [2], "unk": [0]})
    here = dict(recorded, identity="smollm2-135m", tokenizer_sha256="4" * 64)
    assert diffs(recorded, here) == [] and diffs(here, recorded) == []
    other = dict(here, weights={"format": "gguf", "sha256": "5" * 64},
                 config=dict(here["config"], num_hidden_layers=24))
    assert diffs(recorded, other) == [
        "config.num_hidden_layers: 30 != 24",
        "tokenizer_sha256: 'd09447a23ee1...' != '444444444444...'",
        "weights.sha256 (gguf): 'b179c9523d0e...' != '555555555555...'"]
    unhashed = dict(other, weights=None)   # (the same GGUF would settle it)
    assert diffs(dict(unhashed, special_tokens={"bos": [1], "eos": [1], "unk": [0]}), unhashed) == [
        "special_tokens.eos: [1] != [2]"]
    with pytest.raises(EyasError, match=r"x: target does not match \(config.num_hidden_layers: 30 != 24; .*"
                                        r"weights.sha256 \(gguf\).*\); --allow-target-mismatch uses it anyway"):
        check_target(recorded, other, where="x")
    assert "used anyway" in check_target(recorded, other, where="x", allow_mismatch=True)
    # the GPU machine's own record is version 2: refused, the same GGUF notwithstanding
    assert diffs(GPU_5_17_FINGERPRINT, here) == diffs(here, GPU_5_17_FINGERPRINT) == [OLDER.format(v=2)]


@pytest.mark.slow
def test_real_gguf_drafter_from_the_gpu_machine_is_accepted(tmp_path):
    """The embedded GGUF's tokenizer as transformers 5.17 converts it gives the same fingerprint as here; a drafter
    recording that fingerprint is accepted."""
    from eyas.export.export import export_drafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from eyas.target.load import embedded_path, gguf_to_cache

    target = load_target("smollm2-135m")
    cache = gguf_to_cache(embedded_path("smollm2-135m"))
    v517 = as_converted(cache / "tokenizer.json", TOKENIZER_CONFIG_5_17, tmp_path / "5.17")
    gpu = fingerprint(target.model.config, v517, identity="gguf:smollm2.gguf", weights=target.fingerprint["weights"])
    assert {k: v for k, v in gpu.items() if k != "identity"} == {k: v for k, v in target.fingerprint.items()
                                                                 if k != "identity"}
    cfg = DrafterConfig.from_target(target.model.config, draft_vocab_size=256, aux_layer_ids=target.aux_layer_ids)
    out = export_drafter(Eagle3Drafter(cfg), tmp_path / "export", meta={"target": gpu})
    _, meta = open_drafter(out, target=target)
    assert meta["target"] == gpu and "target_mismatch" not in meta


def test_text_config_unwraps_a_wrapper_in_every_spelling():
    """A multimodal wrapper's language model under text_config, whatever the caller holds: a dict of config.json, an
    attribute view of it, or a transformers config; any other config is its own text config."""
    from transformers import LlamaConfig, LlavaConfig

    from eyas.target.fingerprint import text_config

    lm = {"model_type": "deepseek_v3", "num_hidden_layers": 61}
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": lm}
    assert text_config(wrapper) is lm and text_config(lm) is lm
    view = SimpleNamespace(**wrapper)
    assert text_config(view) is lm and text_config(SimpleNamespace(**lm)).num_hidden_layers == 61
    llava = LlavaConfig(text_config=LlamaConfig(num_hidden_layers=3))
    assert text_config(llava) is llava.text_config and text_config(llava.text_config) is llava.text_config


def test_one_text_config_unwrap():
    """The wrapper's text_config is unwrapped in target/fingerprint.py alone: no stage reads the key or
    calls get_text_config itself."""
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[1] / "src"
    pattern = re.compile(r"get_text_config\(|\[\"text_config\"\]|get\(\"text_config\"|\.text_config\b")
    hits = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.py") if pattern.search(p.read_text()))
    assert hits == ["eyas/target/fingerprint.py"], hits
