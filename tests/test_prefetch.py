"""Input prefetch (train/prefetch.py): the thread that makes step N+1's host batches while step N runs changes nothing
that training computes or records, and takes nothing away on failure.

- the same batches in the same order: a run with prefetch trains the bitwise-same drafter, train and eval metrics as
  a run without, offline and online (online: only the collate moves to the thread, the target runs in the loop);
- a resumed run's checkpoints hold the step's data position, not the prefetcher's;
- a corrupt shard found by the thread stops training with the synchronous path's one-line EyasError, at the same
  step, in the caller's thread; an exception or KeyboardInterrupt in a step leaves no thread alive;
- each DDP rank prefetches exactly its own micro-batches;
- data_wait_s (metrics.jsonl) shows a slow input without prefetch, and ~0 with it when the step is slower.
"""

import json
import os
import threading
import time

import pytest
import torch

from test_train import capture, cfg, crashed_run, drafter_state, make_samples, records, tiny_target
from eyas.errors import EyasError
from eyas.train.config import TrainConfig
from eyas.train.prefetch import THREAD_NAME
from eyas.train.trainer import Trainer, run_train


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME) and t.is_alive()]


def read_threads(monkeypatch) -> list[str]:
    """Record the thread of every store read."""
    from eyas.store.reader import Store
    real, names = Store.get_stored, []

    def get(self, i):
        names.append(threading.current_thread().name)
        return real(self, i)
    monkeypatch.setattr(Store, "get_stored", get)
    return names


def all_records(run):
    """Every train and eval record but the wall-clock fields."""
    skip = ("tokens_per_s", "data_wait_s", "time", "elapsed_s")
    return [{k: v for k, v in json.loads(x).items() if k not in skip} for x in open(os.path.join(run, "metrics.jsonl"))]


def test_prefetch_trains_the_bitwise_same_drafter(tmp_path, monkeypatch):
    """Across epochs, with grad_accum 2 and evals: same records (train and eval), same drafter, same checkpoint;
    the prefetch run's store reads all ran in the prefetch threads, the other run's in the main thread."""
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    kw = dict(steps=10, grad_accum=2, eval_every=4, checkpoint_every=5)
    names = read_threads(monkeypatch)
    off = run_train(cfg(tmp_path, store, "off", prefetch=False, **kw), target=t)
    assert set(names) == {"MainThread"}
    names.clear()
    on = run_train(cfg(tmp_path, store, "on", **kw), target=t)
    assert set(names) == {THREAD_NAME, THREAD_NAME + "-eval"}, set(names)

    tr = Trainer(cfg(tmp_path, store, "plan", prefetch=False, **kw), target=t)
    assert len(tr.plan(0)) < 10                            # the run crossed an epoch boundary
    assert all_records(tmp_path / "off") == all_records(tmp_path / "on")
    assert len(records(tmp_path / "on")) == 10 and len(records(tmp_path / "on", "eval")) == 3
    sa, sb = drafter_state(tmp_path / "off"), drafter_state(tmp_path / "on")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert off == on
    assert not prefetch_threads()


def test_resume_with_prefetch_equals_an_uninterrupted_run_without(tmp_path, monkeypatch):
    """Killed after step 6 (its checkpoint at 4), resumed: the same records and drafter as one run without prefetch,
    and the step-4 checkpoint holds the data position the run without prefetch saved (the step's, though the thread
    had already read step 5's input)."""
    from eyas.train.checkpoint import load_checkpoint

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    run_train(cfg(tmp_path, store, "full", steps=8, checkpoint_every=4, keep_checkpoints=3, prefetch=False), target=t)
    crashed_run(monkeypatch, lambda: run_train(cfg(tmp_path, store, "cut", steps=8, checkpoint_every=4,
                                                   keep_checkpoints=3), target=t))
    assert not prefetch_threads()
    (a, _), (b, _) = (load_checkpoint(tmp_path / r / "checkpoints" / "step-4") for r in ("full", "cut"))
    assert a["data"] == b["data"] and a["step"] == b["step"] == 4
    run_train(cfg(tmp_path, store, "cut", steps=8, checkpoint_every=4, keep_checkpoints=3, resume=True), target=t)
    assert all_records(tmp_path / "full") == all_records(tmp_path / "cut")
    sa, sb = drafter_state(tmp_path / "full"), drafter_state(tmp_path / "cut")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _store_with_shards(tmp_path):
    from eyas.capture.capture import CaptureConfig, run_capture
    t = tiny_target()
    store = tmp_path / "store"
    run_capture(CaptureConfig(out=str(store), shard_mb=0.002, batch_tokens=1, progress=False), t,
                samples=make_samples(24))
    return t, store


def test_corrupt_shard_found_by_the_thread_raises_the_sync_error_at_the_same_step(tmp_path, monkeypatch):
    """A shard first read by step 3 gets a flipped bit while step 1 runs (every shard was checked at the start, so
    the per-read check finds the rewrite): with prefetch the thread finds it (while step 2 runs), and training
    stops with the synchronous run's message, after the same logged steps, in the caller's thread."""
    t, store = _store_with_shards(tmp_path)
    kw = dict(steps=6, eval_fraction=0.0)
    tr = Trainer(cfg(tmp_path, str(store), "plan", **kw), target=t)
    shard_of = lambda i: max(k for k, s in enumerate(tr.source.store._starts[:-1]) if s <= i)  # noqa: E731
    first_use: dict[int, int] = {}
    for s, batch in enumerate(tr.plan(0)):
        for i in (i for idx in batch for i in idx):
            first_use.setdefault(shard_of(i), s + 1)
    victim_k = next(k for k, s in sorted(first_use.items(), key=lambda x: x[1]) if 3 <= s <= 6)
    victim = store / tr.source.store.records[victim_k]["file"]
    clean = victim.read_bytes()
    real_step = Trainer.train_step

    def step(self, *a, **k):
        if self.step == 0:   # step 1 runs; the thread is making step 2's input, which does not read the victim
            victim.write_bytes(clean[:-5] + bytes([clean[-5] ^ 1]) + clean[-4:])   # same size
        return real_step(self, *a, **k)
    monkeypatch.setattr(Trainer, "train_step", step)

    names, msgs = read_threads(monkeypatch), {}
    for name, on in (("sync", False), ("pre", True)):
        names.clear()
        victim.write_bytes(clean)
        with pytest.raises(EyasError) as e:
            run_train(cfg(tmp_path, str(store), name, prefetch=on, **kw), target=t)
        msgs[name] = str(e.value)
        assert not prefetch_threads()
        assert names[-1] == (THREAD_NAME if on else "MainThread")    # the failing read's thread
    assert msgs["sync"] == msgs["pre"] and msgs["sync"].startswith(f"{victim}: shard changed on disk"), msgs
    assert "\n" not in msgs["pre"]
    steps = {n: [r["step"] for r in records(tmp_path / n)] for n in ("sync", "pre")}
    assert steps["sync"] == steps["pre"] == list(range(1, first_use[victim_k])), steps


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_exception_or_interrupt_in_a_step_leaves_no_thread(tmp_path, monkeypatch, exc):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(30))
    real, alive = Trainer.train_step, []

    def step(self, *a, **k):
        alive.append(len(prefetch_threads()))
        if self.step + 1 == 3:
            raise exc("stop")
        return real(self, *a, **k)
    monkeypatch.setattr(Trainer, "train_step", step)
    with pytest.raises(exc):
        run_train(cfg(tmp_path, store, steps=6, eval_fraction=0.0), target=t)
    assert alive == [1, 1, 1]                 # the thread ran during the steps ...
    assert not prefetch_threads()             # ... and is gone


def test_online_prefetch_matches_sync_and_the_target_runs_in_the_loop(tmp_path, monkeypatch):
    from eyas.data.prepared import PreparedWriter, Sample
    from eyas.train import feature_cache

    t = tiny_target()
    samples = make_samples(24)
    w = PreparedWriter(tmp_path / "prep", identity={"test": 1})
    for sid, ids, m in samples:
        w.add(Sample(sid, ids, m))
    w.commit(len(samples), {})
    w.finish({"target": t.fingerprint, "counts": {"kept": len(samples)}})
    real, where = feature_cache.target_features, []

    def features(*a, **k):
        where.append(threading.current_thread().name)
        return real(*a, **k)
    monkeypatch.setattr(feature_cache, "target_features", features)
    for name, on in (("off", False), ("on", True)):
        run_train(cfg(tmp_path, None, name, data=str(tmp_path / "prep"), target="custom", steps=5, eval_every=2,
                      prefetch=on), target=t)
    assert where and set(where) == {"MainThread"}
    assert all_records(tmp_path / "off") == all_records(tmp_path / "on")
    assert len(records(tmp_path / "on", "eval")) == 3
    sa, sb = drafter_state(tmp_path / "off"), drafter_state(tmp_path / "on")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _rank_worker(rank, world, port, kw, out):
    import torch.distributed as tdist

    from eyas.train import dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tr = Trainer(TrainConfig(**kw), target=tiny_target())
        made, real = [], tr._host_batch

        def host_batch(idx):
            if threading.current_thread().name == THREAD_NAME:
                made.append(list(idx))
            return real(idx)
        tr._host_batch = host_batch
        tr.train()
        plan = [idx for batch in tr.loader.upcoming(0, 0, tr.total) for idx in batch[1]]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"made": made, "plan": plan}, f)
        dist.teardown(tr.dist)
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


def test_each_ddp_rank_prefetches_its_own_micro_batches(tmp_path):
    """2 gloo ranks: each rank's thread made exactly its own plan's micro-batches, in order (the two plans are
    disjoint), and the run equals one process with grad_accum 2 and no prefetch."""
    import torch.multiprocessing as mp
    from test_train import _free_port

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    single = cfg(tmp_path, store, "single", steps=3, grad_accum=2, deterministic=False, prefetch=False)
    run_train(single, target=t)
    kw = {**single.to_dict(), "out": str(tmp_path / "ddp"), "grad_accum": 1, "prefetch": True}
    mp.spawn(_rank_worker, args=(2, _free_port(), kw, str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for g in got:
        assert g["made"] == g["plan"] and len(g["plan"]) == 3
    assert not {tuple(x) for x in got[0]["plan"]} & {tuple(x) for x in got[1]["plan"]}
    a, b = records(tmp_path / "single"), records(tmp_path / "ddp")
    assert [r["positions_k"] for r in a] == [r["positions_k"] for r in b]
    assert all(abs(ra["loss"] - rb["loss"]) < 1e-5 for ra, rb in zip(a, b))


def test_data_wait_s_shows_a_slow_input_and_prefetch_hides_it(tmp_path, monkeypatch):
    """Input 0.15 s per micro-batch, step 0.4 s: without prefetch every step waits >= 0.15 s; with it only the first
    step waits (nothing to overlap with), the others wait ~0."""
    from eyas.train.data import StoreSource
    from eyas.train.trainer import TTTModule

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(30))
    collate, forward = StoreSource.collate, TTTModule.forward

    def slow_collate(self, idx, pin=False):
        time.sleep(0.15)
        return collate(self, idx, pin=pin)

    def slow_forward(self, *a, **k):
        time.sleep(0.4)
        return forward(self, *a, **k)
    monkeypatch.setattr(StoreSource, "collate", slow_collate)
    monkeypatch.setattr(TTTModule, "forward", slow_forward)
    waits = {}
    for name, on in (("off", False), ("on", True)):
        run_train(cfg(tmp_path, store, name, steps=5, eval_fraction=0.0, prefetch=on), target=t)
        waits[name] = [json.loads(x)["data_wait_s"] for x in open(tmp_path / name / "metrics.jsonl")]
    assert len(waits["off"]) == len(waits["on"]) == 5
    assert all(w >= 0.15 for w in waits["off"]), waits
    assert waits["on"][0] >= 0.1 and all(w < 0.1 for w in waits["on"][1:]), waits
