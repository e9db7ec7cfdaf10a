"""A store's shards are hashed once per machine: later readers, ranks and runs trust the cached sha256 while a
shard's size, mtime and inode stay; any rewrite is hashed again; `eyas store verify` always hashes."""

import os

import pytest

from eyas.errors import EyasError
from eyas.store.reader import Store


@pytest.fixture
def store(tmp_path, monkeypatch):
    from test_prefetch import _store_with_shards

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    _, path = _store_with_shards(tmp_path)
    return path


@pytest.fixture
def hashed(monkeypatch):
    """The files whose bytes were hashed (every sha256 of a whole file goes through one of these two)."""
    import eyas.manifest as manifest
    import eyas.store.verify as verify
    import eyas.target.fingerprint as fp

    seen = []
    real_fp, real_m = fp._bytes_sha256, manifest.sha256_file

    def count_fp(path, *a, **k):
        seen.append(os.path.basename(path))
        return real_fp(path, *a, **k)

    def count_m(path, *a, **k):
        seen.append(os.path.basename(path))
        return real_m(path, *a, **k)
    monkeypatch.setattr(fp, "_bytes_sha256", count_fp)
    monkeypatch.setattr(manifest, "sha256_file", count_m)
    monkeypatch.setattr(verify, "sha256_file", count_m)
    return seen


def test_ranks_split_the_first_check_and_later_readers_hash_nothing(store, hashed):
    files = sorted(r["file"] for r in Store(store).records)
    assert len(files) >= 6
    for rank in (0, 1):
        Store(store).check_shards(rank, 2)
    assert sorted(hashed) == files                 # each shard once, over both ranks
    hashed.clear()
    s = Store(store)
    s.check_shards()
    assert hashed == [] and len(s._handles) == len(files)
    assert s.get(len(s) - 1).final.shape[0] > 0


def test_a_rewritten_shard_is_hashed_again_and_a_corrupt_one_named(store, hashed):
    s = Store(store)
    s.check_shards()
    victim = store / s.records[2]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data)                          # same bytes, a new mtime: hashed again, accepted
    hashed.clear()
    Store(store).check_shards()
    assert hashed == [victim.name]
    victim.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    with pytest.raises(EyasError, match=f"^{victim}: sha256 mismatch"):
        Store(store).check_shards()


def test_store_verify_always_hashes(store, hashed):
    from eyas.store.verify import verify_store

    Store(store).check_shards()
    hashed.clear()
    verify_store(Store(store))
    assert sorted(set(hashed)) == sorted(r["file"] for r in Store(store).records)
