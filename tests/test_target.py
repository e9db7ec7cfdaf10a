"""Target loading: the GGUF cache, layer-id conventions, fingerprints, bad specs."""

import subprocess
import sys

import pytest
import torch

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.target import check_aux_layer_ids, default_aux_layer_ids, load_target, target_from_model


def test_default_aux_ids_follow_eagle3_convention():
    assert default_aux_layer_ids(30) == (2, 15, 27)   # SmolLM2-135M
    assert default_aux_layer_ids(61) == (2, 30, 58)   # DeepSeek-V3 / Kimi-K2
    assert default_aux_layer_ids(32) == (2, 16, 29)   # Llama-3.1-8B


@pytest.mark.parametrize("ids", [(2, 2, 3), (3, 2, 1), (0, 1, 5), (1, 2)])
def test_bad_aux_ids_refused(ids):
    with pytest.raises(EyasError):
        check_aux_layer_ids(ids, 4)


def test_hf_hidden_states_index_is_residual_entering_layer(tiny_llama):
    """hidden_states[i] is the input of decoder layer i and hidden_states[N] is the final norm's
    output (EAGLE3.md section 1). Checked with hooks, since it has changed across versions."""
    model = tiny_llama
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0].clone()))
             for i, layer in enumerate(model.model.layers)]
    hooks.append(model.model.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("norm", o.clone())))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    hs = out.hidden_states
    n = model.config.num_hidden_layers
    assert len(hs) == n + 1
    for i in range(n):
        assert torch.equal(hs[i], seen[i]), i
    assert torch.equal(hs[n], seen["norm"])
    torch.testing.assert_close(out.logits, model.lm_head(hs[n]))


def test_fingerprint_changes_with_config():
    from eyas.manifest import diff_dicts

    a = target_from_model(make_tiny_llama(layers=4))
    b = target_from_model(make_tiny_llama(layers=4, seed=1))
    c = target_from_model(make_tiny_llama(layers=5))
    assert a.fingerprint == b.fingerprint  # same architecture and tokenizer; in-memory weights are not hashed
    assert a.fingerprint["config"]["num_hidden_layers"] != c.fingerprint["config"]["num_hidden_layers"]
    assert diff_dicts(a.fingerprint, c.fingerprint) == ["config.num_hidden_layers: 4 != 5"]


def test_bad_target_specs(tmp_path):
    with pytest.raises(EyasError, match="no such file"):
        load_target(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(EyasError, match="not a GGUF"):
        load_target(str(bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="no config.json"):
        load_target(str(tmp_path / "empty"))
    with pytest.raises(EyasError, match="not an embedded name"):
        load_target("no-such-model")


def test_model_dir_loads_with_identical_logits(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path / "m")
    t = load_target(str(tmp_path / "m"))
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(t.model(ids).logits, tiny_llama(ids).logits)
    assert t.aux_layer_ids == default_aux_layer_ids(4)


def test_cli_unimplemented_or_bad_input_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "eyas", "prepare", "--target", str(tmp_path / "x.gguf"),
                        "--data", "sharegpt", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_embedded_gguf_cache_gives_identical_logits(tmp_path, monkeypatch):
    """The first load dequantises the GGUF; the cached safetensors copy gives the same logits."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from eyas.target.load import embedded_path

    t = load_target("smollm2-135m")
    assert t.num_layers == 30 and t.hidden_size == 576 and t.vocab_size == 49152
    assert t.tie_word_embeddings and t.aux_layer_ids == (2, 15, 27)
    assert t.tokenizer is not None and t.tokenizer.chat_template
    path = embedded_path("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = t.tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(t.model(ids).logits, direct(ids).logits)
    # The second load must come from the safetensors cache, never from the GGUF reader again.
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def no_gguf(cls, *a, **kw):
        assert "gguf_file" not in kw, "the GGUF was dequantised again instead of using the cache"
        return real(cls, *a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(no_gguf))
    again = load_target("smollm2-135m")
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, direct(ids).logits)


@pytest.mark.slow
def test_gguf_cache_of_another_transformers_gets_the_files_eos(tmp_path, monkeypatch):
    """transformers 5.17 caches SmolLM2's GGUF tokenizer with eos `<|im_start|>` (id 1, recorded from that
    version's tokenizer_config.json); the GGUF says 2. A cache like that loads with eos 2 and never stops at 1."""
    import json
    import os
    import shutil

    from eyas.target.load import cache_root, embedded_path, file_sha256

    load_target("smollm2-135m")  # make sure this machine's cache exists
    src = cache_root() / "targets" / file_sha256(embedded_path("smollm2-135m"))[:32]
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    dst = cache_root() / "targets" / src.name
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (os.symlink if f.suffix == ".safetensors" else shutil.copy)(f, dst / f.name)
    conf = json.loads((dst / "tokenizer_config.json").read_text())
    conf.update(eos_token="<|im_start|>", eos_token_id=1)  # what 5.17 wrote
    conf.pop("pad_token", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(conf))
    t = load_target("smollm2-135m")
    assert t.tokenizer.eos_token == "<|im_end|>" and t.tokenizer.eos_token_id == 2
    assert t.tokenizer.pad_token_id == 2 and 1 not in t.eos_token_ids
