"""Capture proofs: hooks == output_hidden_states, known-value layers, logits from the stored final state,
padding, fp8 error, kill -9 + resume, ENOSPC, multi-rank, bad input."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from support.models import make_tiny_llama
from eyas.capture import CaptureConfig, run_capture
from eyas.errors import EyasError
from eyas.store import Store
from eyas.target import target_from_model
from eyas.target.hooks import capture_states
from test_stage_start import TARGET_LINE

ROOT = Path(__file__).resolve().parents[1]


def make_samples(n=12, seed=0, lo=3, hi=40, vocab=256):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        t = int(torch.randint(lo, hi, (1,), generator=g))
        ids = torch.randint(3, vocab, (t,), generator=g).tolist()
        mask = torch.randint(0, 2, (t,), generator=g).tolist()
        out.append((f"conv-{k}", ids, mask))
    return out


def cfg(out, **kw):
    return CaptureConfig(out=str(out), progress=False, **kw)


def test_hooks_equal_output_hidden_states_bitwise():
    model = make_tiny_llama(layers=6)
    ids = torch.randint(0, 256, (3, 17))
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, 5:] = 0
    aux = (0, 2, 5)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    got = capture_states(model, aux, ids, mask)                               # (B, T, 4, h)
    for slot, i in enumerate(aux):
        assert torch.equal(got[:, :, slot], ref.hidden_states[i]), f"aux slot {slot} (layer {i})"
    assert torch.equal(got[:, :, 3], ref.hidden_states[6])
    # aux id N is the final-norm output in the HF convention
    assert torch.equal(capture_states(model, (1, 2, 6), ids, mask)[:, :, 2], ref.hidden_states[6])


def _known_value_model(layers=6):
    """Layer i adds exactly 16 * 2**i to the residual stream; embeddings are 0; final norm weight is 7.

    The residual entering layer L is then 16 * (2**L - 1): distinct per layer and exact in bf16."""
    model = make_tiny_llama(layers=layers)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.zero_()
            layer.self_attn.o_proj.bias = nn.Parameter(torch.full((64,), 16.0 * 2 ** i))
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(7.0)
    return model


def test_known_value_layers_identify_themselves(tmp_path):
    target = target_from_model(_known_value_model(6), aux_layer_ids=(1, 3, 4))
    run_capture(cfg(tmp_path / "s"), target, samples=make_samples(4))
    store = Store(tmp_path / "s", dtype=torch.float32)
    assert store.aux_layer_ids == (1, 3, 4)
    for i in range(len(store)):
        s = store[i]
        for slot, layer in enumerate((1, 3, 4)):
            want = 16.0 * (2 ** layer - 1)   # what layers 0..L-1 added; layer L itself not yet
            assert torch.equal(s.aux[:, slot], torch.full_like(s.aux[:, slot], want)), (slot, layer)
        assert torch.equal(s.final, torch.full_like(s.final, 7.0))


def test_lm_head_of_stored_final_reproduces_logits(tmp_path):
    model = make_tiny_llama(layers=4, seed=3)
    target = target_from_model(model)
    samples = make_samples(6, seed=1)
    # fp32 path: hook capture (no store rounding) -> lm_head == model logits
    ids = torch.tensor([samples[0][1]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        final = capture_states(model, target.aux_layer_ids, ids)[:, :, 3]
        torch.testing.assert_close(model.lm_head(final), logits, rtol=0, atol=1e-5)
    # bf16 store: argmax agreement
    run_capture(cfg(tmp_path / "s"), target, samples=samples)
    store = Store(tmp_path / "s", dtype=torch.float32)
    agree = total = 0
    for sid, tok, _ in samples:
        s = store.by_id(sid)
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([tok])).logits[0]
            got = model.lm_head(s.final)
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(tok)
    print(f"bf16 store argmax agreement {agree}/{total}")
    assert agree / total >= 0.97


def test_padding_does_not_change_states():
    model = make_tiny_llama(layers=4)
    samples = make_samples(5, seed=2)
    T = max(len(s[1]) for s in samples)
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    mask = torch.zeros(len(samples), T, dtype=torch.long)
    for b, (_, tok, _) in enumerate(samples):
        ids[b, :len(tok)] = torch.tensor(tok)
        mask[b, :len(tok)] = 1
    batched = capture_states(model, (1, 2, 3), ids, mask)
    worst = 0.0
    for b, (_, tok, _) in enumerate(samples):
        alone = capture_states(model, (1, 2, 3), torch.tensor([tok]))[0]
        worst = max(worst, float((batched[b, :len(tok)] - alone).abs().max()))
    print(f"padded vs unpadded max abs diff {worst:.2e}")
    assert worst < 1e-5


def test_run_capture_matches_direct_hooks_and_loss_mask(tmp_path):
    model = make_tiny_llama(layers=4)
    target = target_from_model(model)
    samples = make_samples(10, seed=4)
    run_capture(cfg(tmp_path / "s", batch_tokens=96, shard_mb=1), target, samples=samples)
    store = Store(tmp_path / "s", target=target, dtype=torch.float32)
    assert len(store) == 10 and sorted(store.ids) == sorted(s[0] for s in samples)
    for sid, tok, mask in samples:
        s = store.by_id(sid)
        assert s.input_ids.tolist() == tok and s.loss_mask.tolist() == [bool(m) for m in mask]
        ref = capture_states(model, target.aux_layer_ids, torch.tensor([tok]))[0].bfloat16().float()
        diff = (torch.cat([s.aux, s.final[:, None]], 1) - ref).abs().max()
        assert diff <= 0.02 * ref.abs().max(), sid   # batched vs alone may flip one bf16 rounding


def test_fp8_roundtrip_error_per_layer(tmp_path):
    target = target_from_model(make_tiny_llama(layers=6), aux_layer_ids=(1, 3, 5))
    samples = make_samples(8, seed=5)
    run_capture(cfg(tmp_path / "b"), target, samples=samples, )
    run_capture(cfg(tmp_path / "f", dtype="fp8"), target, samples=samples)
    b, f = Store(tmp_path / "b", dtype=torch.float32), Store(tmp_path / "f", dtype=torch.float32)
    num, den = torch.zeros(4), torch.zeros(4)
    for sid, _, _ in samples:
        x, y = b.by_id(sid), f.by_id(sid)
        xs = torch.cat([x.aux, x.final[:, None]], 1)   # (T, 4, h)
        ys = torch.cat([y.aux, y.final[:, None]], 1)
        num += ((ys - xs) ** 2).sum((0, 2))
        den += (xs ** 2).sum((0, 2))
    rel = (num / den).sqrt()
    print("fp8 relative error per state (aux low, mid, high, final):", [f"{r:.4f}" for r in rel.tolist()])
    assert (rel < 0.04).all() and (rel > 0).all()
    ib, if_ = b.info(), f.info()
    print(f"bytes/token bf16 {ib['bytes_per_token']} fp8 {if_['bytes_per_token']}")
    assert if_["bytes"] < 0.6 * ib["bytes"]


def test_bad_layer_ids(tmp_path):
    target = target_from_model(make_tiny_llama(layers=6), aux_layer_ids=(1, 3, 5))
    for layers in [(1, 3, 7), (3, 2, 4), (2, 2, 4), (-1, 2, 3), (1, 2)]:
        with pytest.raises(EyasError, match="aux layer ids"):
            run_capture(cfg(tmp_path / "s", layers=layers), target, samples=make_samples(2))


def test_refuses_store_of_other_config_unless_overwrite(tmp_path):
    target = target_from_model(make_tiny_llama(layers=6), aux_layer_ids=(1, 3, 5))
    samples = make_samples(4)
    run_capture(cfg(tmp_path / "s"), target, samples=samples)
    with pytest.raises(EyasError, match="dtype.*--overwrite"):
        run_capture(cfg(tmp_path / "s", dtype="fp8"), target, samples=samples)
    with pytest.raises(EyasError, match="layers"):
        run_capture(cfg(tmp_path / "s", layers=(1, 2, 3)), target, samples=samples)
    other = target_from_model(make_tiny_llama(layers=6, hidden=32, heads=2, kv_heads=1), aux_layer_ids=(1, 3, 5))
    with pytest.raises(EyasError, match=r"target\.config\.hidden_size: 64 != 32; target\.config\.num_attention_heads: 4 != 2; "
                                        r"target\.config\.num_key_value_heads: 2 != 1\)"):
        run_capture(cfg(tmp_path / "s"), other, samples=samples)
    m = run_capture(cfg(tmp_path / "s", dtype="fp8", overwrite=True), target, samples=samples)
    assert m["dtype"] == "fp8" and Store(tmp_path / "s").info()["dtype"] == "fp8"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(EyasError, match="not an eyas store"):
        run_capture(cfg(tmp_path / "junk"), target, samples=samples)
    (tmp_path / "file").write_text("x")
    with pytest.raises(EyasError, match="not a directory"):
        run_capture(cfg(tmp_path / "file"), target, samples=samples)
    with pytest.raises(EyasError, match="cannot create the store directory"):
        run_capture(cfg(tmp_path / "file" / "sub"), target, samples=samples)


def test_bad_samples(tmp_path):
    target = target_from_model(make_tiny_llama())
    with pytest.raises(EyasError, match="'a'.*vocabulary"):
        run_capture(cfg(tmp_path / "s"), target, samples=[("a", [1, 999], [0, 1])])
    with pytest.raises(EyasError, match="'b'.*loss-mask"):
        run_capture(cfg(tmp_path / "s"), target, samples=[("b", [1, 2], [0])])
    with pytest.raises(EyasError, match="twice"):
        run_capture(cfg(tmp_path / "s"), target, samples=[("c", [1], [1]), ("c", [2], [1])])


def _store_dump(path):
    s = Store(path, dtype=torch.float32)
    return {s.ids[i]: (s[i].input_ids, s[i].loss_mask, s[i].aux, s[i].final) for i in range(len(s))}


def _assert_same_store(a, b):
    da, db = _store_dump(a), _store_dump(b)
    assert sorted(da) == sorted(db)
    for k in da:
        for x, y in zip(da[k], db[k]):
            assert torch.equal(x, y), k


def test_enospc_leaves_consistent_store_and_resumes(tmp_path, monkeypatch):
    import eyas.store.writer as w
    target = target_from_model(make_tiny_llama())
    samples = make_samples(12, seed=6)
    kw = dict(batch_tokens=1, shard_mb=0.05, writer_threads=1)   # one sample per batch; ~3 samples per shard
    real, calls = w._write_file, []

    def full_disk(path, data):
        calls.append(path)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(w, "_write_file", full_disk)
    with pytest.raises(EyasError, match=r"shard-r000-00001.safetensors: disk full .*No space left.*rerun"):
        run_capture(cfg(tmp_path / "s", **kw), target, samples=samples)
    assert not [p for p in os.listdir(tmp_path / "s") if p.startswith(".")]
    partial = Store(tmp_path / "s", allow_incomplete=True)
    assert 0 < len(partial) < 12 and partial.verify()["ok"]
    with pytest.raises(EyasError, match="incomplete"):
        Store(tmp_path / "s")
    monkeypatch.setattr(w, "_write_file", real)
    run_capture(cfg(tmp_path / "s", **kw), target, samples=samples)
    run_capture(cfg(tmp_path / "ref", **kw), target, samples=samples)
    Store(tmp_path / "s").verify()
    _assert_same_store(tmp_path / "s", tmp_path / "ref")


KILL_SCRIPT = textwrap.dedent("""
    import json, sys, time, torch
    sys.path[:0] = [{tests!r}, {src!r}]
    from support.models import make_tiny_llama
    from eyas.target import target_from_model
    from eyas.capture import CaptureConfig, run_capture
    model = make_tiny_llama()
    if {slow}:
        model.model.layers[0].register_forward_pre_hook(lambda *a: time.sleep(0.1))
    samples = json.load(open({samples!r}))
    run_capture(CaptureConfig(out={out!r}, batch_tokens=1, shard_mb=0.015, progress=False),
                target_from_model(model), samples=samples)
""")


def _run_script(tmp_path, out, samples, slow):
    import json
    sp = tmp_path / "samples.json"
    sp.write_text(json.dumps(samples))
    code = KILL_SCRIPT.format(tests=str(ROOT / "tests"), src=str(ROOT / "src"), slow=slow,
                              samples=str(sp), out=str(out))
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_kill_9_then_resume_equals_uninterrupted(tmp_path, monkeypatch):
    # Shards of 0.015 MiB hold ~1-2 samples of ~20 tokens here (512 B/token): ~15 shards in a run.
    samples = make_samples(24, seed=7, lo=10, hi=30)
    out = tmp_path / "killed"
    proc = _run_script(tmp_path, out, samples, slow=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and len(list(out.glob("shard-*.json"))) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "capture finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = Store(out, allow_incomplete=True)
    assert 0 < len(partial) < len(samples)
    partial.verify()
    # resume in-process (same configuration), then compare with an uninterrupted run
    target = target_from_model(make_tiny_llama())
    m = run_capture(cfg(out, batch_tokens=1, shard_mb=0.015), target, samples=samples)
    assert m["complete"] and m["num_samples"] == len(samples)
    assert not [p for p in os.listdir(out) if p.startswith(".")]
    store = Store(out)
    assert len(store) == len(set(store.ids)) == len(samples)
    store.verify()
    run_capture(cfg(tmp_path / "ref", batch_tokens=1, shard_mb=0.015), target, samples=samples)
    _assert_same_store(out, tmp_path / "ref")


def test_two_ranks_write_one_store(tmp_path):
    target = target_from_model(make_tiny_llama())
    samples = make_samples(9, seed=8)
    m1 = run_capture(cfg(tmp_path / "s"), target, samples=samples, rank=1, world_size=2)
    assert not m1["complete"]
    with pytest.raises(EyasError, match="incomplete"):
        Store(tmp_path / "s")
    m0 = run_capture(cfg(tmp_path / "s"), target, samples=samples, rank=0, world_size=2)
    assert m0["complete"] and m0["num_samples"] == 9
    store = Store(tmp_path / "s")
    assert store.info()["ranks"] == [0, 1]
    store.verify()
    run_capture(cfg(tmp_path / "ref"), target, samples=samples)
    _assert_same_store(tmp_path / "s", tmp_path / "ref")


@pytest.mark.slow
def test_eyas_capture_under_torchrun_writes_one_store_and_exits_cleanly(tmp_path):
    """`torchrun --nproc_per_node 2 -m eyas capture` (gloo on the CPU): both ranks exit 0 and leave one complete
    store with shards of both ranks, equal sample for sample to a one-process capture."""
    from test_faults import _cli_target_and_data

    from eyas.target import load_target
    tdir, prep, n = _cli_target_and_data(tmp_path)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1", "EYAS_CACHE": str(tmp_path / "c")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "eyas", "capture", "--target", str(tdir), "--data", str(prep), "--out",
                        str(tmp_path / "s"), "--batch-tokens", "32", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    store = Store(tmp_path / "s")
    assert store.info()["ranks"] == [0, 1] and len(store) == n
    store.verify()
    run_capture(cfg(tmp_path / "ref", data=str(prep), batch_tokens=32), load_target(str(tdir)))
    _assert_same_store(tmp_path / "s", tmp_path / "ref")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_capture_matches_cpu(tmp_path):
    """The CUDA path (side-stream copy to the host in the writer) stores the same states as the CPU path."""
    samples = make_samples(16, seed=9)
    cpu = target_from_model(make_tiny_llama())
    run_capture(cfg(tmp_path / "cpu", batch_tokens=128, shard_mb=0.02), cpu, samples=samples)
    gpu = target_from_model(make_tiny_llama().cuda())
    run_capture(cfg(tmp_path / "gpu", batch_tokens=128, shard_mb=0.02, device="cuda"), gpu, samples=samples)
    a, b = _store_dump(tmp_path / "cpu"), _store_dump(tmp_path / "gpu")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1])
        for x, y in zip(a[k][2:], b[k][2:]):
            assert (x - y).abs().max() <= 0.02 * x.abs().max(), k


def _prepared(path, target, samples):
    from eyas.data.prepared import PreparedWriter, Sample
    w = PreparedWriter(path, identity={"target": target.fingerprint})
    for sid, ids, mask in samples:
        w.add(Sample(id=sid, input_ids=ids, loss_mask=mask))
    w.commit(len(samples), {})
    w.finish({"target": target.fingerprint, "counts": {"kept": len(samples)}})


def test_prepared_data_path_and_other_target_refused(tmp_path):
    target = target_from_model(make_tiny_llama())
    samples = make_samples(5, seed=10)
    _prepared(tmp_path / "prep", target, samples)
    m = run_capture(cfg(tmp_path / "s", data=str(tmp_path / "prep")), target)
    assert m["complete"] and m["data"]["source"] == "prepared"
    run_capture(cfg(tmp_path / "ref"), target, samples=samples)
    a, b = _store_dump(tmp_path / "s"), _store_dump(tmp_path / "ref")
    assert all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))
    other = target_from_model(make_tiny_llama(vocab=300))
    with pytest.raises(EyasError, match=r"prep: target does not match \(config\.vocab_size: 256 != 300"):
        run_capture(cfg(tmp_path / "s2", data=str(tmp_path / "prep")), other)


# ---- the overlapped pipeline (side-stream copies, intake and writer threads) against the synchronous path
def _assert_same_files(sync, overlapped):
    """Every shard and sidecar byte for byte, and the manifests equal but for the switch and the directory."""
    a, b = sorted(os.listdir(sync)), sorted(os.listdir(overlapped))
    assert a == b and len(a) > 5 and not [p for p in a if p.startswith(".")], (a, b)
    for name in a:
        if name != "manifest.json":
            assert (sync / name).read_bytes() == (overlapped / name).read_bytes(), name
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (sync, overlapped))
    assert (ma["config"].pop("overlap"), mb["config"].pop("overlap")) == (False, True)
    ma["config"].pop("out"), mb["config"].pop("out")
    assert ma == mb and ma["complete"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_overlapped_capture_writes_the_synchronous_store(tmp_path, dtype):
    """On the CPU the same pipeline runs without streams or pinning; its files equal the one-thread path's."""
    target = target_from_model(make_tiny_llama())
    samples = make_samples(40, seed=12, lo=3, hi=60)    # padded batches of several samples, ~15 shards
    for overlap in (False, True):
        run_capture(cfg(tmp_path / str(overlap), dtype=dtype, batch_tokens=96, shard_mb=0.02, writer_threads=3,
                        overlap=overlap), target, samples=samples)
    _assert_same_files(tmp_path / "False", tmp_path / "True")
    Store(tmp_path / "True").verify()


def test_writer_thread_error_surfaces_in_the_main_thread_and_resumes(tmp_path, monkeypatch):
    import eyas.store.writer as w
    target = target_from_model(make_tiny_llama())
    samples = make_samples(12, seed=13)
    kw = dict(batch_tokens=1, shard_mb=0.02, writer_threads=3)
    real, calls = w._write_file, []

    def broken(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("injected fault in the writer thread")
        real(path, data)

    monkeypatch.setattr(w, "_write_file", broken)
    with pytest.raises(EyasError, match=r"shard writer failed \(RuntimeError\('injected fault in the writer thread'"):
        run_capture(cfg(tmp_path / "s", **kw), target, samples=samples)
    monkeypatch.setattr(w, "_write_file", real)
    assert not [p for p in os.listdir(tmp_path / "s") if p.startswith(".")]   # no temp file, the lock released
    assert Store(tmp_path / "s", allow_incomplete=True).verify()["ok"]
    assert run_capture(cfg(tmp_path / "s", **kw), target, samples=samples)["complete"]
    run_capture(cfg(tmp_path / "ref", overlap=False, **kw), target, samples=samples)
    _assert_same_store(tmp_path / "s", tmp_path / "ref")


def test_disk_full_in_a_writer_thread_is_one_cli_line_and_resumes(tmp_path, monkeypatch, capsys):
    """`eyas capture` (4 writer threads): ENOSPC in the third shard write -> exit 2, one line naming the shard and
    what the store keeps; rerunning completes a store equal sample for sample to a synchronous capture."""
    import eyas.store.writer as w
    from test_faults import _cli_target_and_data
    from test_hostile import is_progress

    from eyas.cli import main
    from eyas.target import load_target
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    tdir, prep, n = _cli_target_and_data(tmp_path)
    out = tmp_path / "store"
    argv = ["capture", "--target", str(tdir), "--data", str(prep), "--out", str(out), "--batch-tokens", "1",
            "--shard-mb", "0.001"]
    real, calls = w._write_file, []

    def full_disk(path, data):
        calls.append(path)
        if len(calls) == 3:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(w, "_write_file", full_disk)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for ln in err.splitlines() for x in ln.split("\r")      # less the progress bars
             if x.strip() and not is_progress(x) and not re.match(r"capture r0: +\d+%\|", x)
             and not TARGET_LINE.fullmatch(x)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.fullmatch(rf"eyas capture: error: {re.escape(str(out))}/shard-r000-\d{{5}}\.safetensors: disk full "
                        r"while writing a shard \(No space left on device\); the store keeps its \d+ committed "
                        r"samples, free space / fix the directory and rerun to resume", lines[0]), lines[0]
    assert not [p for p in os.listdir(out) if p.startswith(".")]
    assert Store(out, allow_incomplete=True).verify()["ok"]
    monkeypatch.setattr(w, "_write_file", real)
    assert main(argv) == 0
    run_capture(cfg(tmp_path / "ref", data=str(prep), batch_tokens=1, shard_mb=0.001, overlap=False),
                load_target(str(tdir)))
    _assert_same_store(out, tmp_path / "ref")
    assert len(Store(out)) == n


def test_keyboard_interrupt_leaves_a_resumable_store(tmp_path, monkeypatch):
    """Ctrl-C in the main thread while shards are in flight: the threads stop, what was committed stays, no temp
    file or lock is left, and rerunning completes the store."""
    import eyas.capture.capture as cap
    target = target_from_model(make_tiny_llama())
    samples = make_samples(24, seed=14, lo=10, hi=30)
    kw = dict(batch_tokens=1, shard_mb=0.015, writer_threads=2)
    out, real, calls = tmp_path / "s", cap.capture_states, [0]

    def interrupted(*a, **k):
        calls[0] += 1
        if calls[0] == 12:
            deadline = time.time() + 30
            while not list(out.glob("shard-*.json")) and time.time() < deadline:   # a shard has committed
                time.sleep(0.01)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cap, "capture_states", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_capture(cfg(out, **kw), target, samples=samples)
    monkeypatch.setattr(cap, "capture_states", real)
    assert not [p for p in os.listdir(out) if p.startswith(".")]
    partial = Store(out, allow_incomplete=True)
    assert 0 < len(partial) < len(samples) and partial.verify()["ok"]
    assert run_capture(cfg(out, **kw), target, samples=samples)["complete"]
    run_capture(cfg(tmp_path / "ref", overlap=False, **kw), target, samples=samples)
    _assert_same_store(out, tmp_path / "ref")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_overlapped_capture_writes_the_synchronous_store(tmp_path, dtype):
    """On CUDA: pinned staging buffers, side-stream copies, intake and writer threads == .cpu() after every
    forward in one thread, file for file."""
    gpu = target_from_model(make_tiny_llama().cuda())
    samples = make_samples(40, seed=12, lo=3, hi=60)
    for overlap in (False, True):
        run_capture(cfg(tmp_path / str(overlap), dtype=dtype, batch_tokens=96, shard_mb=0.02, device="cuda",
                        writer_threads=3, overlap=overlap), gpu, samples=samples)
    _assert_same_files(tmp_path / "False", tmp_path / "True")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_copies_are_ordered_and_outlive_the_callers_tensors(tmp_path, dtype):
    """The caller frees each batch at once and the allocator's next block is filled with NaN on the same stream
    while the side-stream copy may still be pending: the store still holds exactly the CPU writer's bytes."""
    from eyas.store import StoreWriter
    from eyas.store import format as fmt
    g = torch.Generator().manual_seed(15)
    header = {"target": {"identity": "t"}, "layers": {"aux": [1, 2, 3]}, "dtype": dtype, "hidden_size": 256,
              "vocab_size": 100, "data": {"source": "test"}, "config": {}}
    batches = []
    for b in range(24):
        lengths = [int(torch.randint(200, 2000, (1,), generator=g)) for _ in range(3)]
        N = sum(lengths)
        q, s = fmt.quantize(torch.randn(N, 4, 256, generator=g) * 3, dtype)
        batches.append(([f"b{b}-{j}" for j in range(3)], lengths, torch.randint(0, 100, (N,), generator=g,
                        dtype=torch.int32), torch.randint(0, 2, (N,), generator=g, dtype=torch.uint8), q, s))
    for where in ("cpu", "cuda"):
        w = StoreWriter(tmp_path / where, header=header, shard_bytes=4 << 20, threads=2, overlap=where == "cuda")
        for ids, lengths, input_ids, mask, q, s in batches:
            if where == "cuda":
                q, s = q.cuda(), None if s is None else s.cuda()
                torch.cuda._sleep(2_000_000)   # the side-stream copy waits for this, and so does the fill below
            w.add(ids, lengths, input_ids, mask, q, s)
            if where == "cuda":
                sizes = [t.numel() * t.element_size() for t in (q, s) if t is not None]
                del q, s
                for n in sizes:   # the block just freed, if the allocator were allowed to hand it out: NaN bytes
                    torch.empty(n, dtype=torch.uint8, device="cuda").fill_(255)
        w.close()
        w.finalize({i for b in batches for i in b[0]})
    for p in (tmp_path / "cpu").iterdir():
        assert p.read_bytes() == (tmp_path / "cuda" / p.name).read_bytes(), p.name
