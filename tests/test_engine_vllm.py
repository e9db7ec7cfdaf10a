"""vLLM extract_hidden_states files -> eyas store: vLLM's file names, its pre-norm last slot, bad files caught."""

import json
import secrets

import pytest
import torch
from safetensors.torch import save_file

from support.engine_fakes import H, header, true_states
from support.engine_vllm_fake import FakeVllmServer, save_tiny_target, vllm_states
from eyas.cli import main
from eyas.engines.capture import run_engine_capture
from eyas.engines.client import EngineCaptureConfig
from eyas.target.layers import default_aux_layer_ids
from eyas.engines.final_norm import FinalNorm, load_final_norm
from eyas.engines.vllm_ingest import ingest_dir
from eyas.store.reader import Store
from eyas.store.writer import StoreWriter

SAMPLES = {"a": list(range(5, 17)), "b": list(range(40, 49)), "c": list(range(70, 80))}
MASKS = {k: [1] * len(v) for k, v in SAMPLES.items()}
NORM = FinalNorm(torch.linspace(0.5, 1.5, H), 1e-5)


def norm_target(d, h=H):
    """A target checkpoint as far as ingest reads it: config.json and the final norm NORM (no transformers)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "num_hidden_layers": 6, "hidden_size": h, "vocab_size": 1000,
                                               "rms_norm_eps": NORM.eps}))
    save_file({"model.norm.weight": NORM.weight.clone()}, str(d / "model.safetensors"))
    return d / "config.json"


def vllm_file(d, sid, ids=None, layers=4, dtype=torch.bfloat16, nan=False, attempt=0):
    """A file as vLLM names it for eyas's request_id `{sid}#a{attempt}`: cmpl-{rid}-0-{8 hex}."""
    ids = SAMPLES[sid] if ids is None else ids
    aux, final = true_states(ids)
    hs = torch.cat([aux, final[:, None]], dim=1)[:, :layers].to(dtype)     # (T, n_layers, H)
    if nan:
        hs[1, 0, 0] = float("nan")
    name = d / f"cmpl-{sid}#a{attempt}-0-{secrets.token_hex(4)}.safetensors"
    save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(name))
    (d / f"{name.name}.lock").touch()
    return name


def ingest(src, out, samples=SAMPLES, **kw):
    w = StoreWriter(out, header=header())
    written, rejected = ingest_dir(src, w, samples, MASKS, final_norm=NORM, **kw)
    w.close()
    return w, written, rejected


def test_ingest_finds_vllm_named_files_verifies_and_never_writes_twice(tmp_path):
    src, out = tmp_path / "vllm", tmp_path / "store"
    src.mkdir()
    vllm_file(src, "a")
    vllm_file(src, "b", ids=SAMPLES["b"][:-2])                # truncated: token count differs
    vllm_file(src, "c", layers=3)                             # launched without the final layer id
    _, written, rejected = ingest(src, out)
    assert written == ["a"]
    reasons = {r.sample_id: r.reason for r in rejected}
    assert "token count" in reasons["b"] and "expected (T, 4, H)" in reasons["c"]
    s = Store(out, allow_incomplete=True).by_id("a", dtype=torch.float32)
    aux, pre = true_states(SAMPLES["a"])
    assert torch.equal(s.aux, aux.bfloat16().float())
    assert torch.equal(s.final, NORM(pre.bfloat16()).bfloat16().float())    # the norm applied to slot 3
    vllm_file(src, "b", attempt=1)                            # retries: newer attempts are tried first
    vllm_file(src, "c", attempt=1)
    w, written, rejected = ingest(src, out)
    assert written == ["b", "c"] and rejected == []
    m = w.finalize(set(SAMPLES))
    assert m["complete"] and sorted(Store(out).ids) == ["a", "b", "c"]


@pytest.mark.parametrize("bad", ["ids", "nan", "missing", "other_sample"])
def test_bad_files_rejected(tmp_path, bad):
    src = tmp_path / "vllm"
    src.mkdir()
    if bad == "ids":
        vllm_file(src, "a", ids=[1] + SAMPLES["a"][1:])
    elif bad == "nan":
        vllm_file(src, "a", nan=True)
    elif bad == "other_sample":
        vllm_file(src, "b")                                  # cmpl-b#a0-...: not sample "a"'s file
    _, written, rejected = ingest(src, tmp_path / "store", samples={"a": SAMPLES["a"]})
    assert written == [] and len(rejected) == 1
    assert {"ids": "token ids differ", "nan": "non-finite", "missing": "no file",
            "other_sample": "no file"}[bad] in rejected[0].reason


def launch(capsys, tmp_path, model_dir, vllm_dir):
    cfg = model_dir / "config.json"
    assert main(["engine", "launch-args", "vllm", "--target-config", str(cfg), "--model", str(model_dir),
                 "--vllm-dir", str(vllm_dir), "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out.replace("\\\n", " ")
    import shlex
    return shlex.split(out)


def reference(model, ids):
    """In-process truth: HF hidden_states at the aux ids, and the final-norm output (hidden_states[N])."""
    with torch.inference_mode():
        o = model(input_ids=torch.tensor(ids)[None], output_hidden_states=True)
    return o.hidden_states, o.logits[0]


def test_capture_through_vllm_stores_the_final_norm_output(capsys, tmp_path):
    """launch-args -> (stand-in) vLLM -> capture client -> store: every request served, and the stored
    final state is the final-norm output whose lm_head gives the target's logits, not vLLM's pre-norm slot."""
    model_dir, vllm_dir, out = tmp_path / "target", tmp_path / "vllm", tmp_path / "store"
    model = save_tiny_target(model_dir)
    n = model.config.num_hidden_layers
    srv = FakeVllmServer(launch(capsys, tmp_path, model_dir, vllm_dir), model)
    samples = {f"s{i}": torch.randint(3, 250, (9 + i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(4)}
    prep = ({"target": {"identity": "tiny", "config_sha256": "0", "tokenizer_sha256": "0"}}, samples,
            {k: [1] * len(v) for k, v in samples.items()})
    cfg = EngineCaptureConfig(engine="vllm", url="http://fake", data="fake", out=str(out), vllm_dir=str(vllm_dir),
                              target_config=str(model_dir / "config.json"), retries=0)
    aux_ids = list(default_aux_layer_ids(n))   # what launch-args asked vLLM for (the shallow fallback: n = 6)
    m = run_engine_capture(cfg, aux_layer_ids=aux_ids, hidden_size=model.config.hidden_size,
                           vocab_size=model.config.vocab_size, samples=prep, post=srv.post)
    assert m["complete"] and srv.calls == len(samples)
    st = Store(out)
    for sid, ids in samples.items():
        s = st.by_id(sid, dtype=torch.float32)
        hs, logits = reference(model, ids)
        pre = vllm_states(model, ids, [n])[:, 0]
        assert (pre - hs[n][0]).abs().max() > 0.1                 # the slot vLLM writes is not the final state
        assert torch.allclose(s.final, hs[n][0], atol=0.03, rtol=0.02)
        assert torch.equal(model.lm_head(s.final).argmax(-1), logits.argmax(-1))
        for k, a in enumerate(aux_ids):
            assert torch.allclose(s.aux[:, k], hs[a][0], atol=0.03, rtol=0.02)


def write_prepared(prep, samples):
    from eyas.data.prepared import PreparedWriter, Sample
    w = PreparedWriter(prep, identity={"test": 1})
    for sid, ids in samples.items():
        w.add(Sample(id=sid, input_ids=ids, loss_mask=MASKS.get(sid, [1] * len(ids))))
    w.commit(len(samples), {})
    w.finish({"counts": {"kept": len(samples)}})
    return prep


def test_ingest_vllm_command_reads_vllm_names_and_the_norm(capsys, tmp_path):
    model_dir, vllm_dir, out, prep = tmp_path / "target", tmp_path / "vllm", tmp_path / "store", tmp_path / "prep"
    model = save_tiny_target(model_dir)
    n = model.config.num_hidden_layers
    samples = {"x": list(range(3, 14)), "y": list(range(30, 37))}
    write_prepared(prep, samples)
    srv = FakeVllmServer(launch(capsys, tmp_path, model_dir, vllm_dir), model)
    for sid, ids in samples.items():                        # requests as the client sends them
        srv.post("http://fake/v1/completions", {"model": srv.served[0], "prompt": ids, "request_id": f"{sid}#a0"}, 1)
    StoreWriter(out, header={**header(), "hidden_size": model.config.hidden_size}).close()
    assert main(["engine", "ingest-vllm", "--vllm-dir", str(vllm_dir), "--data", str(prep), "--out", str(out),
                 "--target-config", str(model_dir / "config.json")]) == 0
    assert json.loads(capsys.readouterr().out)["complete"]
    for sid, ids in samples.items():
        hs, _ = reference(model, ids)
        assert torch.allclose(Store(out).by_id(sid, dtype=torch.float32).final, hs[n][0], atol=0.03, rtol=0.02)


def test_final_norm_found_in_sharded_and_wrapped_checkpoints(tmp_path):
    """Kimi-K2.5 keeps it at language_model.model.norm.weight, behind a safetensors index."""
    d = tmp_path / "kimi"
    d.mkdir()
    w = torch.rand(8) + 0.5
    save_file({"language_model.model.norm.weight": w, "language_model.model.layers.60.mtp.norm.weight": w * 0},
              str(d / "model-00002.safetensors"))
    save_file({"vision_tower.norm.weight": w * 0}, str(d / "model-00001.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "language_model.model.norm.weight": "model-00002.safetensors",
        "language_model.model.layers.60.mtp.norm.weight": "model-00002.safetensors",
        "vision_tower.norm.weight": "model-00001.safetensors"}}))
    (d / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                               "text_config": {"hidden_size": 8, "rms_norm_eps": 1e-6}}))
    norm = load_final_norm(d / "config.json")
    assert torch.equal(norm.weight, w) and norm.eps == 1e-6


def ingest_cli(tmp_path, samples) -> list[str]:
    """Arguments of `eyas engine ingest-vllm` from tmp_path/vllm into a fresh store for prepared `samples`."""
    StoreWriter(tmp_path / "store", header=header()).close()
    return ["engine", "ingest-vllm", "--vllm-dir", str(tmp_path / "vllm"), "--data",
            str(write_prepared(tmp_path / "prep", samples)), "--out", str(tmp_path / "store"),
            "--target-config", str(norm_target(tmp_path / "target"))]


def test_ingest_vllm_skips_bad_files_counts_them_and_resumes(capsys, tmp_path):
    """A truncated file and one of the wrong shape are skipped, not fatal: the good sample is ingested, one stderr
    line counts the skips by reason, STORE/skipped.jsonl names each file; a rerun after vLLM wrote new attempts
    ingests only the missing samples and completes the store."""
    src, out = tmp_path / "vllm", tmp_path / "store"
    src.mkdir()
    vllm_file(src, "a")
    cut = vllm_file(src, "b")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])           # a writer killed mid-file
    wrong = vllm_file(src, "c", layers=3)                                 # launched without the final layer id
    args = ingest_cli(tmp_path, SAMPLES)
    assert main(args) == 0                                                # something was ingested
    res, err = capsys.readouterr()
    summary = json.loads(res)
    assert summary["written"] == 1 and not summary["complete"]
    assert summary["skipped"] == {"unreadable file": 1, "wrong shape": 1}
    assert err.count("\n") == 1 and "skipped 2 (" in err and "1 unreadable file" in err and "1 wrong shape" in err
    assert "2 of 3 samples are not in the store" in err and str(out / "skipped.jsonl") in err
    log = [json.loads(x) for x in (out / "skipped.jsonl").read_text().splitlines()]
    assert {(x["id"], x["reason"], x["where"]) for x in log} == {("b", "unreadable file", str(cut)),
                                                                 ("c", "wrong shape", str(wrong))}
    assert Store(out, allow_incomplete=True).ids == ["a"]

    vllm_file(src, "b", attempt=1)                                        # the client re-requested them
    vllm_file(src, "c", attempt=1)
    assert main(args) == 0
    res, err = capsys.readouterr()
    summary = json.loads(res)
    assert summary["written"] == 2 and summary["complete"] and summary["skipped"] == {} and err == ""
    assert (out / "skipped.jsonl").read_text() == ""                      # this run skipped nothing
    st = Store(out)
    assert sorted(st.ids) == ["a", "b", "c"] and len(st.records) == 2     # "a" was not written again
    aux, _ = true_states(SAMPLES["c"])
    assert torch.equal(st.by_id("c", dtype=torch.float32).aux, aux.bfloat16().float())


def test_ingest_vllm_fails_only_when_nothing_was_ingested(capsys, tmp_path):
    src = tmp_path / "vllm"
    src.mkdir()
    bad = vllm_file(src, "a")
    bad.write_bytes(b"not a safetensors file")
    assert main(ingest_cli(tmp_path, {"a": SAMPLES["a"]})) == 1
    res, err = capsys.readouterr()
    assert json.loads(res)["written"] == 0 and "1 unreadable file" in err and err.count("\n") == 1
