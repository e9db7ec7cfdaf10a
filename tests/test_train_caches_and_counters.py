"""Training's caches and counters where a one-line change went unnoticed before: the feature cache's room on the
device and the host with the memory probe replaced (train/feature_cache.py), the input wait summed over a run
(train/prefetch.py), alpha_k with kept target ids (train/ttt.py), and which shards each rank hashes before training
(store/reader.py)."""

from __future__ import annotations

import time

import pytest
import torch

from eyas.store.reader import Store
from eyas.train import feature_cache as fc
from eyas.train.prefetch import Prefetcher
from eyas.train.ttt import TTTConfig, ttt_forward
from test_store_hash_once import hashed, store  # noqa: F401 (fixtures: a store of >= 6 shards, the files hashed)
from test_ttt import make_case, ttt_inputs

G = 10**9


def fake_memory(monkeypatch, *, cuda=(0, 0), cpu=(0, 0)):
    """The memory probe (bytes free, bytes in all) answering for a CUDA card and the host."""
    monkeypatch.setattr(fc, "memory", lambda device: cuda if torch.device(device).type == "cuda" else cpu)


# ------------------------------------------------------------------ train/feature_cache.py

def test_the_device_room_leaves_the_larger_of_the_two_margins(monkeypatch):
    """An 80 GB card leaves 16 GB (its 20% share); a 100 GB card leaves 20 GB (20% > 16 GB); a 40 GB card leaves
    16 GB (more than its 20%): the device part of an unbounded cache is what is free less that margin."""
    cuda = torch.device("cuda")
    for free, total, room in ((70 * G, 80 * G, 54 * G), (60 * G, 100 * G, 40 * G), (30 * G, 40 * G, 14 * G)):
        fake_memory(monkeypatch, cuda=(free, total), cpu=(0, 64 * G))
        cache, where = fc.plan("auto", 500 * G, cuda)
        assert cache.capacity_bytes == room and cache.device == cuda, (free, total)
        assert where == f"{room / G:.1f} GB in cuda ({room / (500 * G):.0%} of 500.0 GB of states)"


@pytest.mark.parametrize("ranks", [1, 4])
def test_the_ranks_of_a_host_share_its_room(monkeypatch, ranks):
    """LOCAL_WORLD_SIZE ranks on one host each take their share of its room (available memory less the larger of
    4 GB and 25% of RAM): 40 GB available of 64 GB leaves 24 GB, 6 GB a rank for four ranks."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    fake_memory(monkeypatch, cuda=(20 * G, 80 * G), cpu=(40 * G, 64 * G))
    cache, _ = fc.plan("auto", 500 * G, torch.device("cpu"))
    assert cache.capacity_bytes == 24 * G // ranks and cache.device.type == "cpu"
    # on CUDA the host's share holds the pinned part (a power of two of it: torch's pinned allocator rounds up)
    cache, _ = fc.plan("auto", 500 * G, torch.device("cuda"))
    assert cache.parts[1].pinned and cache.parts[1].capacity_bytes == 1 << ((24 * G // ranks).bit_length() - 1)


# ------------------------------------------------------------------ train/prefetch.py

def test_wait_s_is_the_total_wait_of_every_get():
    """Each job takes 0.1 s and the caller asks for it at once: every get waits, and wait_s is their sum (what
    the run logs as data_wait_s), as timed by the caller."""
    def slow(job):
        time.sleep(0.1)
        return job

    waited = 0.0
    with Prefetcher(((i, i) for i in range(4)), slow) as pf:
        for i in range(4):
            t0 = time.perf_counter()
            assert pf.get(i) == i
            waited += time.perf_counter() - t0
        assert waited >= 0.3 and pf.wait_s <= waited and pf.wait_s >= waited - 0.05


# ------------------------------------------------------------------ train/ttt.py

def test_alpha_with_the_target_ids_of_an_earlier_pass_is_alpha_without_them():
    """target_ids kept from an earlier pass skip the full-vocab product only where alpha is not measured: alpha
    needs the target's mass on the draft vocabulary, so with alpha=True the result is the pass without them."""
    d, c = make_case(seed=3, B=2, T=10)
    cfg = TTTConfig(num_steps=3)
    with torch.no_grad():
        first = ttt_forward(d, **ttt_inputs(c), cfg=cfg, alpha=True)
        again = ttt_forward(d, **ttt_inputs(c), cfg=cfg, alpha=True, target_ids=first.target_ids)
        plain = ttt_forward(d, **ttt_inputs(c), cfg=cfg, target_ids=first.target_ids)
    assert float(first.alpha_k.sum()) > 0 and again.alpha_k is not None and plain.alpha_k is None
    torch.testing.assert_close(again.alpha_k, first.alpha_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(again.loss, first.loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(again.correct_k, first.correct_k) and torch.equal(plain.correct_k, first.correct_k)


# ------------------------------------------------------------------ store/reader.py

def test_each_rank_hashes_only_its_own_shards(store, hashed):  # noqa: F811 (fixtures)
    """Ranks split the first check of the shards: rank r of 3 hashes shards r, r+3, ... and none of the others,
    on a cold cache; together they hash each shard once."""
    files = [r["file"] for r in Store(store).records]
    assert len(files) >= 6
    for rank in range(3):
        hashed.clear()
        Store(store).check_shards(rank, 3)
        assert hashed == files[rank::3], rank
