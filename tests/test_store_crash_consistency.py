"""The store writer under a full disk, SIGKILL and a crash between the steps of a commit: the manifest and its
committed count never get ahead of the shards on disk, and a shard is fsynced before its rename, the directory
after it, before the commit. Updating the manifest
before the shard is written fails the enospc and kill_9 tests; renaming before the fsync, or no directory fsync,
fails test_fsync_before_rename_before_commit."""

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eyas.errors import EyasError
from eyas.manifest import MANIFEST, read_manifest
from eyas.store import Store, StoreWriter
from eyas.store import format as fmt

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


# ------------------------------------------------------------------ store: manifest vs shards, fsync order

H = 8


def header():
    return {"target": {"identity": "tiny", "config_sha256": "c", "tokenizer_sha256": None},
            "layers": {"aux": [1, 2, 3]}, "dtype": "bf16", "hidden_size": H, "vocab_size": 100,
            "data": {"source": "test"}, "config": {}}


def store_samples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(n):
        t = 3 + k
        out[f"s{k}"] = (torch.randint(0, 100, (t,), generator=g), torch.randint(0, 2, (t,), generator=g),
                        torch.randn(t, 3, H, generator=g), torch.randn(t, H, generator=g))
    return out


def assert_manifest_agrees(path, expected_samples):
    """The manifest counts what a reader sees, and every shard it lists is on disk at its size."""
    m = read_manifest(path, kind=fmt.KIND)
    reader = Store(path, allow_incomplete=True)
    assert m["num_samples"] == len(reader) == expected_samples, (m["num_samples"], len(reader))
    assert m["num_shards"] == len(m["shards"]) == len(reader.records)
    assert sorted(s["file"] for s in m["shards"]) == [r["file"] for r in reader.records]
    for s in m["shards"]:
        f = path / s["file"]
        assert f.exists() and f.stat().st_size == s["bytes"], s["file"]
    reader.verify()


def finish_and_compare(path, samples):
    """Resume the interrupted store with the missing samples; it must equal the samples exactly."""
    w = StoreWriter(path, header=header(), shard_bytes=1, threads=1)
    for sid, (ids, mask, aux, final) in samples.items():
        if sid not in w.committed_ids:
            w.add_sample(sid, ids, mask, aux, final)
    w.close()
    assert w.finalize(set(samples))["complete"]
    store = Store(path, dtype=torch.float32)
    assert sorted(store.ids) == sorted(samples) and len(store.ids) == len(set(store.ids))
    store.verify()
    for sid, (ids, mask, aux, final) in samples.items():
        s = store.by_id(sid)
        assert torch.equal(s.input_ids, ids) and torch.equal(s.aux, aux.bfloat16().float()), sid
    assert not [p for p in os.listdir(path) if p.startswith(".")]


def test_manifest_matches_shards_after_enospc(tmp_path, monkeypatch):
    import eyas.store.writer as writer
    samples = store_samples(6)
    real, calls = writer._write_file, []

    def full_disk(path, data):
        calls.append(path)
        if len(calls) == 3:  # the third shard: half written, then the disk is full
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(writer, "_write_file", full_disk)
    p = tmp_path / "s"
    w = StoreWriter(p, header=header(), shard_bytes=1, threads=1)  # one sample per shard
    with pytest.raises(EyasError, match="disk full") as err:
        try:
            for sid, (ids, mask, aux, final) in samples.items():
                w.add_sample(sid, ids, mask, aux, final)
            w.close()
        finally:
            w.abort()
    said = int(re.search(r"keeps its (\d+) committed samples", str(err.value)).group(1))
    assert said == 2, str(err.value)
    assert_manifest_agrees(p, said)
    monkeypatch.setattr(writer, "_write_file", real)
    finish_and_compare(p, samples)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path[:0] = [{tests!r}, {src!r}]
    import eyas.store.writer as writer
    from test_store_crash_consistency import header, store_samples
    real, calls = writer._write_file, []

    def killed(path, data):
        calls.append(path)
        if len(calls) == {kill_at}:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, data)

    writer._write_file = killed
    w = writer.StoreWriter({out!r}, header=header(), shard_bytes=1, threads=1)
    for sid, (ids, mask, aux, final) in store_samples({n}).items():
        w.add_sample(sid, ids, mask, aux, final)
    w.close()
""")


@pytest.mark.parametrize("kill_at", [1, 3])
def test_manifest_matches_shards_after_kill_9(tmp_path, kill_at):
    """kill -9 in the middle of writing shard `kill_at`: the manifest lists exactly the committed shards."""
    p, n = tmp_path / "s", 6
    code = KILL_SCRIPT.format(tests=str(ROOT / "tests"), src=str(ROOT / "src"), out=str(p), n=n, kill_at=kill_at)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert_manifest_agrees(p, kill_at - 1)
    finish_and_compare(p, store_samples(n))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fsync'd descriptors")
def test_fsync_before_rename_before_commit(tmp_path, monkeypatch):
    """Per shard: fsync(temp file) < rename(temp -> shard) < fsync(directory) < rename(-> sidecar) <
    rename(-> manifest); the sidecar and manifest temp files are fsync'd before their renames too."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, **kw)

    p = tmp_path / "s"
    p.mkdir()
    p = p.resolve()
    samples = store_samples(3)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    w = StoreWriter(p, header=header(), shard_bytes=1, threads=1)
    for sid, (ids, mask, aux, final) in samples.items():
        w.add_sample(sid, ids, mask, aux, final)
    w.close()
    w.finalize(set(samples))
    monkeypatch.undo()

    def index(ev, start=0):
        return next((i for i in range(start, len(events)) if events[i] == ev), None)

    def renamed_to(dst, start=0):
        return next((i for i in range(start, len(events)) if events[i][0] == "replace" and events[i][2] == dst), None)

    shards = sorted(x.name for x in p.glob("shard-*.safetensors"))
    assert len(shards) == 3
    for name in shards:
        tmp, final, side = str(p / f".{name}.tmp"), str(p / name), str(p / fmt.sidecar_name(name))
        synced = index(("fsync", tmp))
        moved = index(("replace", tmp, final))
        assert synced is not None and moved is not None and synced < moved, (name, events)
        dir_synced = index(("fsync", str(p)), moved)
        committed = renamed_to(side, moved)
        assert dir_synced is not None and committed is not None and dir_synced < committed, (name, events)
        side_tmp = events[committed][1]
        assert index(("fsync", side_tmp)) is not None and index(("fsync", side_tmp)) < committed, name
        assert renamed_to(str(p / MANIFEST), committed) is not None, name
    for i, ev in enumerate(events):  # every rename's source was fsync'd before it
        if ev[0] == "replace":
            assert ("fsync", ev[1]) in events[:i], ev
