"""The feature cache of online training (eyas.train.feature_cache): a run that keeps each sample's target states from
their first forward trains the drafter a run without it trains, bit for bit, while the target runs only in the
first epoch; under a budget smaller than the data it keeps the first samples and recomputes the rest; a resumed
run (empty cache) refills and ends where an uninterrupted one ends; DDP ranks keep the samples of their own
micro-batches. Batches assembled from the cache are the online path's, padding included.

The end-to-end runs use samples of one length: the target's forward of a sample then sees the same shapes in every
micro-batch and is itself bitwise repeatable (on the CPU a sample's states change in the last bits with the padded
length of its batch), so a run without the cache is a bitwise reference.
"""

import json
import os

import pytest
import torch

from eyas.errors import EyasError
from eyas.target.hooks import decoder_stack
from eyas.train import feature_cache as fc
from eyas.train.config import TrainConfig
from eyas.train.data import _pad, target_features
from eyas.train.trainer import Trainer
from test_train import V, _free_port, cfg, make_samples, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

L = 16          # the end-to-end runs' sample length


def prepared(tmp_path, samples, name="prep"):
    from eyas.data.prepared import PreparedWriter, Sample

    w = PreparedWriter(tmp_path / name, identity={"test": 1})
    for sid, ids, m in samples:
        w.add(Sample(sid, ids, m))
    w.commit(len(samples), {})
    w.finish({"target": tiny_target().fingerprint, "counts": {"kept": len(samples)}})
    return str(tmp_path / name)


def equal_length_samples(n=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, V, (L,), generator=g).tolist()
        cut = int(torch.randint(2, L - 4, (1,), generator=g))
        out.append((f"s{i}", ids, [0] * cut + [1] * (L - cut)))
    return out


def online_cfg(tmp_path, data, name, **kw):
    base = dict(data=data, target="custom", steps=None, epochs=3, batch_tokens=64, ttt_steps=2, eval_fraction=0.25)
    return cfg(tmp_path, None, name, **{**base, **kw})


PACKED = {"unpacked": dict(pack="off"), "packed": dict(pack="on", max_len=32)}   # packed: 2 rows of 32 tokens


class Spy:
    """Per target forward: the trainer's epoch and mode; per target_features call: its sample ids."""

    def __init__(self, monkeypatch, target):
        self.tr, self.forwards, self.calls = None, [], []
        real = fc.target_features

        def spied(t, batch, *a, **kw):
            self.calls.append((self.tr.epoch, self.tr.module.training, list(batch.ids)))
            return real(t, batch, *a, **kw)
        monkeypatch.setattr(fc, "target_features", spied)
        self.hook = decoder_stack(target.model).register_forward_pre_hook(
            lambda m, a: self.forwards.append(self.tr.epoch))

    def computed(self, epochs=None, training=None) -> list[str]:
        return [i for e, t, ids in self.calls for i in ids
                if (epochs is None or e in epochs) and (training is None or t == training)]


def train(tmp_path, target, c, spy=None):
    tr = Trainer(c, target=target)
    if spy is not None:
        spy.tr = tr
    result = tr.train()
    return tr, result


def lines(run):
    """metrics.jsonl without the wall-clock fields."""
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "data_wait_s")} for r in rows]


def drafter(run):
    from safetensors.torch import load_file
    return load_file(os.path.join(run, "drafter", "model.safetensors"))


def assert_same_run(tmp_path, a, b):
    assert lines(tmp_path / a) == lines(tmp_path / b)
    da, db = drafter(tmp_path / a), drafter(tmp_path / b)
    assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("rows", list(PACKED))
def test_cache_trains_the_same_drafter_and_runs_the_target_in_the_first_epoch_only(tmp_path, monkeypatch, rows):
    t = tiny_target()
    data = prepared(tmp_path, equal_length_samples())
    spy = Spy(monkeypatch, t)
    off, r_off = train(tmp_path, t, online_cfg(tmp_path, data, "off", feature_cache="off", **PACKED[rows]), spy)
    assert set(spy.forwards) == {0, 1, 2}              # without the cache the target runs every epoch
    spy.calls, spy.forwards = [], []
    on, r_on = train(tmp_path, t, online_cfg(tmp_path, data, "on", **PACKED[rows]), spy)

    assert off.total == on.total >= 9 and len(off.plan(0)) >= 3
    assert set(spy.forwards) == {0}                     # training and the first eval (end of epoch 1) only
    done = spy.computed()
    assert len(done) == len(set(done)) == len(on.train_idx) + len(on.eval_idx)   # each sample once
    assert set(spy.computed(training=False)) == {on.source.ids[i] for i in on.eval_idx}
    assert len([r for r in lines(tmp_path / "on") if r["split"] == "eval"]) == 3  # evals gathered twice
    assert r_on == r_off
    assert_same_run(tmp_path, "on", "off")
    assert on.fcache.buf is None                        # released at the end of train()


def test_budget_smaller_than_the_data_keeps_the_first_samples_and_trains_the_same(tmp_path, monkeypatch):
    t = tiny_target()
    data = prepared(tmp_path, equal_length_samples())
    train(tmp_path, t, online_cfg(tmp_path, data, "off", feature_cache="off"))
    per_token = 4 * t.hidden_size * 4                   # aux | final in fp32
    kept = 7                                            # samples that fit
    budget = (kept * L + L // 2) * per_token            # and half of the next one
    spy = Spy(monkeypatch, t)
    on, _ = train(tmp_path, t, online_cfg(tmp_path, data, "on", feature_cache=str(budget / 1e9)), spy)
    first = spy.computed(epochs={0})
    assert len(first) == len(set(first)) == len(on.train_idx) + len(on.eval_idx)
    prefix = set(first[:kept])
    later = spy.computed(epochs={1, 2})
    assert later and not prefix & set(later)            # the first `kept` samples are gathered ...
    assert set(later) == set(first) - prefix            # ... and every other one runs again
    assert_same_run(tmp_path, "on", "off")


def test_resume_in_the_second_epoch_refills_and_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    from test_train import crashed_run

    t = tiny_target()
    data = prepared(tmp_path, equal_length_samples())
    full, _ = train(tmp_path, t, online_cfg(tmp_path, data, "full"))
    per_epoch = len(full.plan(0))
    cut = per_epoch + per_epoch // 2                    # a checkpoint in the middle of the second epoch
    crashed_run(monkeypatch, lambda: train(tmp_path, t, online_cfg(tmp_path, data, "cut", checkpoint_every=cut)),
                step=cut + 1)

    spy = Spy(monkeypatch, t)
    resumed, _ = train(tmp_path, t, online_cfg(tmp_path, data, "cut", checkpoint_every=cut, resume=True), spy)
    assert resumed.step == full.step and spy.calls[0][0] == 1   # it started in the second epoch, cache empty
    ids = resumed.source.ids
    rest = {ids[i] for step in resumed.plan(1)[cut - per_epoch:] for mb in step for i in mb}
    done = spy.computed()
    assert len(done) == len(set(done))                  # each sample computed once in the resumed process:
    assert set(spy.computed(epochs={1}, training=True)) == rest            # the rest of its second epoch
    assert set(spy.computed(epochs={2})) == {ids[i] for i in resumed.train_idx} - rest   # then what it lacks
    assert_same_run(tmp_path, "cut", "full")


def test_padding_never_reaches_the_drafter(tmp_path, monkeypatch):
    """Why target_features may zero its padding (the cache's layout): a run whose online padding holds large
    garbage trains the drafter, metrics and evals of the zero-padded run, bit for bit (mixed lengths, unpacked)."""
    t = tiny_target()
    data = prepared(tmp_path, make_samples(24))
    kw = dict(feature_cache="off", pack="off", epochs=1)
    train(tmp_path, t, online_cfg(tmp_path, data, "zeros", **kw))
    real, padded = fc.target_features, []

    def garbage(target, batch, *a, **k):
        b = real(target, batch, *a, **k)
        pad = ~batch.valid[..., None]
        assert torch.count_nonzero(b.aux * pad) == 0     # zeros from the online path itself
        padded.append(int(pad.sum()))
        b.aux = torch.where(pad, torch.randn_like(b.aux) * 1e3, b.aux)
        b.final = torch.where(pad, torch.randn_like(b.final) * 1e3, b.final)
        return b
    monkeypatch.setattr(fc, "target_features", garbage)
    train(tmp_path, t, online_cfg(tmp_path, data, "garbage", **kw))
    assert sum(padded) > 20
    assert_same_run(tmp_path, "garbage", "zeros")


# ------------------------------------------------------------------------------------------ the cache itself
def check_assembly(t, cache, sub_tokens, device="cpu"):
    """Mixed lengths: a micro-batch of held and new samples gets the held ones' first-computed states, the new
    ones' states from the target, zeros on padding, in the online path's shape and dtype; then the new ones are
    held too."""
    samples = make_samples(12)
    toks = [(torch.tensor(ids), torch.tensor(m)) for _, ids, m in samples]
    lengths = [len(x) for x, _ in toks]

    def batch(idx):
        return _pad([samples[i][0] for i in idx], [toks[i] for i in idx], 64).to(device)

    a_idx, b_idx = [0, 1, 2, 3, 4], [7, 3, 0, 9, 5]
    parts = getattr(cache, "parts", [cache])
    held = lambda: {i for p in parts for i in p.at}                                         # noqa: E731
    a = fc.online_features(cache, t, batch(a_idx), a_idx, [lengths[i] for i in a_idx], sub_tokens)
    assert held() == set(a_idx) and parts[0].buf.dtype == a.aux.dtype == t.dtype        # never a lossier dtype
    b = fc.online_features(cache, t, batch(b_idx), b_idx, [lengths[i] for i in b_idx], sub_tokens)
    online = target_features(t, batch(b_idx), sub_tokens=sub_tokens)
    assert b.aux.shape == online.aux.shape and b.final.shape == online.final.shape
    assert b.aux.dtype == online.aux.dtype and b.aux.device == online.aux.device
    assert b.aux.is_contiguous() and b.final.is_contiguous()
    pad = ~online.valid[..., None]
    for x in (b.aux, b.final, online.aux, online.final):
        assert torch.count_nonzero(x * pad) == 0        # zeros on padding, both paths
    tol = dict(rtol=1e-5, atol=1e-6) if t.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for r, i in enumerate(b_idx):
        n = lengths[i]
        if i in a_idx:                                  # held: exactly the states of its first forward
            ra = a_idx.index(i)
            assert torch.equal(b.aux[r, :n], a.aux[ra, :n]) and torch.equal(b.final[r, :n], a.final[ra, :n])
        else:                                           # new: the target's states (to rounding: other shapes)
            torch.testing.assert_close(b.aux[r, :n], online.aux[r, :n], **tol)
    assert held() == set(a_idx) | set(b_idx) and sum(p.top for p in parts) == sum(lengths[i] for i in held())
    c = fc.online_features(cache, t, batch(b_idx), b_idx, [lengths[i] for i in b_idx], sub_tokens)
    assert torch.equal(c.aux, b.aux) and torch.equal(c.final, b.final)   # all held now: gathered whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sub_tokens", [None, 48], ids=["whole", "groups"])
def test_assembled_batch_is_the_online_layout_with_the_first_computed_states(sub_tokens, dtype):
    t = tiny_target()
    t.model.to(dtype)
    check_assembly(t, fc.FeatureCache(1 << 20, torch.device("cpu")), sub_tokens)


def test_assembled_batch_from_two_parts_is_the_one_buffer_batch():
    """A cache in two parts (room for about two samples in the first): the later samples go to the second part,
    and a micro-batch gathered from both is the online layout with the first-computed states, as from one buffer."""
    t = tiny_target()
    first = 2 * 24 * 4 * t.hidden_size * 4                       # two samples of 24 tokens of fp32 states
    cache = fc.Tiers([fc.FeatureCache(first, torch.device("cpu")), fc.FeatureCache(1 << 20, torch.device("cpu"))])
    check_assembly(t, cache, None)
    assert cache.parts[0].at and cache.parts[1].at and cache.parts[0].full
    assert not set(cache.parts[0].at) & set(cache.parts[1].at)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["device", "pinned host"])
def test_gpu_assembled_batch_from_the_device_or_pinned_host(where):
    """The CUDA paths: a cache on the device (gathered there) or in pinned host memory (device-to-host copies
    waited for, gathered on the host, copied up), bf16 as the target gives it."""
    t = tiny_target()
    t.model.to("cuda", torch.bfloat16)
    pinned = where == "pinned host"
    cache = fc.FeatureCache(1 << 20, torch.device("cpu" if pinned else "cuda"), pinned=pinned)
    for sub_tokens in (None, 48):
        check_assembly(t, cache, sub_tokens, "cuda")
        assert cache.buf.is_pinned() == pinned and cache.buf.is_cuda != pinned
        cache = fc.FeatureCache(1 << 20, cache.device, pinned=pinned)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_assembled_batch_from_the_device_and_pinned_host_parts():
    """The split plan() makes when neither room holds all: the first samples on the device, the rest in pinned host
    memory, one micro-batch gathered from both."""
    t = tiny_target()
    t.model.to("cuda", torch.bfloat16)
    first = 2 * 24 * 4 * t.hidden_size * 2                       # two samples of 24 tokens of bf16 states
    cache, where = fc.plan("auto", first + (1 << 20), torch.device("cuda"), rooms=(first, 1 << 30))
    assert "pinned host memory" in where and [p.device.type for p in cache.parts] == ["cuda", "cpu"]
    check_assembly(t, cache, None, "cuda")
    assert cache.parts[0].buf.is_cuda and cache.parts[1].buf.is_pinned() and cache.parts[1].at


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_training_runs_the_target_in_the_first_epoch_only(tmp_path, monkeypatch, capsys):
    """On CUDA (packed rows, bf16 autocast, the 'auto' budget): the cache lives on the device, the target runs in
    the first epoch only, and the run trains as the uncached one does (to the rounding of other batch shapes)."""
    t = tiny_target()
    t.model.to("cuda")
    data = prepared(tmp_path, equal_length_samples())
    kw = dict(device="cuda", deterministic=False, pack="on", max_len=32)
    _, r_off = train(tmp_path, t, online_cfg(tmp_path, data, "off", feature_cache="off", **kw))
    spy = Spy(monkeypatch, t)
    on, r_on = train(tmp_path, t, online_cfg(tmp_path, data, "on", **kw), spy)
    assert "feature cache: " in capsys.readouterr().err and on.fcache.device.type == "cuda"
    assert set(spy.forwards) == {0}
    assert r_on["eval"]["positions_k"] == r_off["eval"]["positions_k"]
    assert r_on["eval"]["loss"] == pytest.approx(r_off["eval"]["loss"], rel=5e-2)


def test_placement_device_first_then_pinned_host_for_the_rest():
    cuda, cpu, G = torch.device("cuda"), torch.device("cpu"), 10**9

    def parts(setting, need, rooms, dev=cuda):
        cache = fc.plan(setting, need, dev, rooms=rooms)[0]
        return [(p.device, p.pinned, p.capacity_bytes) for p in getattr(cache, "parts", [cache])]

    assert parts("auto", 10 * G, (100 * G, 200 * G)) == [(cuda, False, 10 * G)]
    assert parts("auto", 10 * G, (0, 200 * G)) == [(cpu, True, 10 * G)]           # no room on the card: all pinned
    assert parts("auto", 10 * G, (5 * G, 200 * G)) == [(cuda, False, 5 * G), (cpu, True, 5 * G)]
    # the host's room as the allocator sees it: 6 GB of room take a pinned request of at most 2^32 bytes
    assert parts("auto", 10 * G, (5 * G, 6 * G)) == [(cuda, False, 5 * G), (cpu, True, 1 << 32)]
    assert parts("2", 10 * G, (5 * G, 8 * G)) == [(cuda, False, 2 * G)]              # a budget: that much
    assert parts("7", 10 * G, (5 * G, 8 * G)) == [(cuda, False, 5 * G), (cpu, True, 2 * G)]
    assert parts("auto", 10 * G, (5 * G, 8 * G), cpu) == [(cpu, False, 5 * G)]      # CPU: the host is the device
    assert fc.plan("off", 10 * G, cuda, rooms=(100 * G, 100 * G))[0] is None
    assert fc.plan("auto", 10 * G, cuda, rooms=(-1 * G, -2 * G))[0] is None
    line = fc.plan("auto", 10 * G, cuda, rooms=(0, 200 * G))[1]
    assert line == "10.0 GB in pinned host memory (all 10.0 GB of states)"
    assert fc.plan("auto", 10 * G, cuda, rooms=(5 * G, 6 * G))[1] == (
        "5.0 GB in cuda + 4.3 GB in pinned host memory (93% of 10.0 GB of states)")


def test_feature_cache_setting_is_checked_and_a_flag(tmp_path):
    from eyas.cli import build_parser
    from eyas.knobs import from_args

    with pytest.raises(EyasError, match="feature_cache must be auto, off or a size in GB"):
        TrainConfig(out=str(tmp_path), data="d", target="t", feature_cache="lots")
    with pytest.raises(EyasError, match="feature_cache"):
        TrainConfig(out=str(tmp_path), data="d", target="t", feature_cache="-1")
    args = build_parser().parse_args(["train", "--data", "d", "--target", "t", "--out", "x", "--feature-cache", "0.5"])
    assert from_args(TrainConfig, args).feature_cache == "0.5"                      # `eyas train --feature-cache`
    a = TrainConfig(out=str(tmp_path), data="d", target="t")
    b = TrainConfig(out=str(tmp_path), data="d", target="t", feature_cache="off")
    assert a.feature_cache == "auto" and a.identity() == b.identity()   # a resume may change it


# ------------------------------------------------------------------------------------------------- DDP
def _ddp_worker(rank, world, port, kw, out):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen = {}
    try:
        for name, setting in (("ddp-off", "off"), ("ddp-on", "auto")):
            t = tiny_target()
            calls = []
            real = fc.target_features
            fc.target_features = lambda tg, b, *a, **k: (calls.append((tr.epoch, tr.module.training, b.ids)),
                                                         real(tg, b, *a, **k))[1]
            tr = Trainer(TrainConfig(**{**kw, "out": os.path.join(out, name), "feature_cache": setting}), target=t)
            mine = sorted({tr.source.ids[i] for e in range(3) for step in tr.plan(e) for mb in step for i in mb})
            tr.train()
            fc.target_features = real
            seen[name] = {"calls": calls, "mine": mine}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(seen, f)


def test_ddp_ranks_each_keep_the_samples_of_their_own_micro_batches(tmp_path):
    import torch.multiprocessing as mp

    data = prepared(tmp_path, equal_length_samples(32))
    kw = online_cfg(tmp_path, data, "x", deterministic=False).to_dict()
    mp.spawn(_ddp_worker, args=(2, _free_port(), kw, str(tmp_path)), nprocs=2, join=True)
    assert_same_run(tmp_path, "ddp-on", "ddp-off")
    ranks = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for seen in ranks:
        off, on = seen["ddp-off"], seen["ddp-on"]
        done = [i for *_, ids in on["calls"] for i in ids]
        assert len(done) == len(set(done))                      # each sample computed once on this rank
        assert {i for _, training, ids in on["calls"] if training for i in ids} == set(on["mine"])
        assert len([i for *_, ids in off["calls"] for i in ids]) > len(done)
    first = [{i for e, training, ids in seen["ddp-on"]["calls"] if e == 0 and training for i in ids} for seen in ranks]
    assert first[0] and first[1] and not first[0] & first[1]    # epoch 1: each rank its own half, once


@pytest.mark.slow
def test_throughput_benchmark_times_the_two_part_cache(tmp_path):
    """benchmarks.train --feature-cache split (the next lease's measure of the device + pinned host plan) times a
    row whose states are gathered from both parts of a two-part cache (the benchmark asserts that every sample is
    held), beside the online row it is compared with."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.train", "--device", "cpu", "--shapes", "tiny",
                        "--seqs", "128", "--batch-tokens", "1024", "--steps", "1", "--attention", "dense", "--online",
                        "--feature-cache", "off,split", "--no-record", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]),
                            "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [x["feature_cache"] for x in rows] == ["off", "split"]
    off, split = rows
    assert off["cache_samples"] == [] and len(split["cache_samples"]) == 2 and min(split["cache_samples"]) >= 1
    assert split["tokens"] == off["tokens"] and split["feat_ms"] > 0
    assert "cache (split)" in r.stdout
