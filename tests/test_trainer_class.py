"""The Trainer's own contract: state_dict() / load_state_dict() is a complete resume point (bit-identical to an
uninterrupted run, across an epoch boundary, over a trainer that had already moved on), state_dict() is what the
checkpoint on disk holds, evaluate() leaves training untouched, train/setup.py's run-directory refusals and lr
schedule, and train/dist.py's collectives and teardown on two gloo ranks."""

import io
import json
import math
import os

import pytest
import torch

from eyas.errors import EyasError
from eyas.manifest import write_manifest
from eyas.train import checkpoint as ckpt
from eyas.train.setup import KIND, check_run_dir, schedule
from eyas.train.trainer import Trainer
from test_faults import _ckpt_equal
from test_train import _free_port, capture, cfg, make_samples, records, tiny_target


def _without_out(state):
    return {**state, "config": {k: v for k, v in state["config"].items() if k != "out"}}


def test_state_dict_round_trip_resumes_bit_identically(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    # on the CPU: unpacked micro-batches give an epoch several steps (auto packing on CUDA makes it one here)
    kw = dict(steps=None, epochs=2, checkpoint_every=0, eval_fraction=0.2, device="cpu")

    ref = Trainer(cfg(tmp_path, store, "ref", **kw), target=t)
    per_epoch = len(ref.plan(0))
    cut = per_epoch - 1                       # mid epoch 0: the resumed part crosses into epoch 1
    assert per_epoch >= 3 and ref.total == per_epoch + len(ref.plan(1))
    ref_result = ref.train()

    a = Trainer(cfg(tmp_path, store, "a", **kw), target=t)
    for _ in range(cut):
        a.train_step(a.next_batch())
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)           # through bytes, as a checkpoint: plain types only
    rng = ckpt.rng_state()

    b = Trainer(cfg(tmp_path, store, "b", **kw), target=t)
    b.train_step(b.next_batch())              # b has moved too: params, Adam moments, lr schedule, data position
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert (b.step, b.epoch, b.pos) == (cut, 0, cut)
    ckpt.set_rng_state(rng)
    b_result = b.train()

    # Everything a checkpoint holds is bit-identical: drafter, optimizer moments, scheduler, data position, tokens.
    assert b.step == ref.step == ref.total and b.epoch == ref.epoch == 2
    _ckpt_equal(_without_out(b.state_dict()), _without_out(ref.state_dict()), "state")
    assert b_result == ref_result
    later = [r for r in records(tmp_path / "ref") if r["step"] > cut]
    assert records(tmp_path / "b") == later and len(later) == ref.total - cut
    assert records(tmp_path / "b", "eval") == records(tmp_path / "ref", "eval")   # end of epoch 0 and the last step

    # state_dict() is what RUN/checkpoints/step-N/state.pt holds.
    state, _ = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "ref"))
    _ckpt_equal(state, ref.state_dict(), "state.pt")


def test_evaluate_leaves_training_untouched(tmp_path):
    """Held-out evals (every step here) change no train record and no bit of the trainer's state."""
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    kw = dict(steps=4, eval_fraction=0.3, device="cpu")
    plain = Trainer(cfg(tmp_path, store, "plain", **kw), target=t)
    plain.train()
    often = Trainer(cfg(tmp_path, store, "often", eval_every=1, **kw), target=t)
    before = _without_out(often.state_dict())
    first = often.evaluate()
    _ckpt_equal(_without_out(often.state_dict()), before, "state after evaluate")
    assert often.evaluate() == first and first["positions_k"][0] > 0
    often.train()
    assert records(tmp_path / "often") == records(tmp_path / "plain")
    assert [r["step"] for r in records(tmp_path / "often", "eval")] == [1, 2, 3, 4]
    _ckpt_equal(_without_out(often.state_dict()), _without_out(plain.state_dict()), "state")


# ------------------------------------------------------------------------------------------ setup.py
def test_check_run_dir_refuses_what_is_not_a_fresh_or_resumable_run(tmp_path):
    c = cfg(tmp_path, "store", "run")
    run = tmp_path / "run"
    run.write_text("x")
    with pytest.raises(EyasError, match="exists and is not a directory"):
        check_run_dir(c, run)
    run.unlink()
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match="not empty and not an eyas training run"):
        check_run_dir(c, run)
    assert (run / "notes.txt").read_text() == "mine"          # refused, untouched
    (run / "notes.txt").unlink()

    # a run killed before its first manifest: only vocab/ and temp files, cleared and reused
    (run / "vocab").mkdir()
    (run / "vocab" / "draft_vocab.safetensors").write_bytes(b"half")
    (run / ".manifest.json.tmp-123").write_text("{")
    check_run_dir(c, run)
    assert run.is_dir() and not any(run.iterdir())

    write_manifest(run, {"kind": "capture"})
    with pytest.raises(EyasError, match="holds a 'capture' directory, not a training run"):
        check_run_dir(c, run)
    write_manifest(run, {"kind": KIND, "version": ckpt.VERSION, "config_identity": c.identity()})
    check_run_dir(c, run)                                      # a manifest and no checkpoint: start over
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    with pytest.raises(EyasError, match="pass --resume or choose another --out"):
        check_run_dir(c, run)
    check_run_dir(cfg(tmp_path, "store", "run", resume=True), run)
    with pytest.raises(EyasError, match="training configuration"):
        check_run_dir(cfg(tmp_path, "store", "run", resume=True, lr=2e-3), run)
    # a run of another version (none recorded: an older eyas's) is not resumed: one line, naming the way out
    write_manifest(run, {"kind": KIND, "config_identity": c.identity()})
    with pytest.raises(EyasError, match=rf"^{run / 'manifest.json'}: a training run of version 1 \(an older eyas's\), "
                                        rf"this eyas resumes version {ckpt.VERSION}; train into another --out, or "
                                        rf"delete {run} to start again$"):
        check_run_dir(cfg(tmp_path, "store", "run", resume=True), run)


def test_schedule_warms_up_linearly_then_cosine_to_the_floor(tmp_path):
    c = cfg(tmp_path, "store", warmup_ratio=0.25, min_lr_ratio=0.1)
    f = schedule(c, 8)                                         # 2 warm-up steps, then 6 of cosine
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert f(8) == pytest.approx(0.1) and f(20) == pytest.approx(0.1)
    assert all(f(s) > f(s + 1) for s in range(2, 8))
    assert schedule(cfg(tmp_path, "store", warmup_ratio=0.0), 4)(0) == 1.0


# ------------------------------------------------------------------------------------------ dist.py
def _dist_worker(rank, world, port, out):
    from eyas.train import dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    d = dist.setup("cpu")                     # torchrun's environment, no group yet: setup creates it
    seen = {"rank": d.rank, "world": d.world, "owns": d.owns_group,
            "any_1": dist.any_rank(d.rank == 1, d.device), "any_none": dist.any_rank(False, d.device),
            "gathered": dist.gather_lists([f"r{d.rank}"] * (d.rank + 1))}
    dist.barrier()
    dist.teardown(d)
    seen["after_teardown"] = torch.distributed.is_initialized()
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(seen, f)


def test_dist_collectives_and_teardown_on_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    from eyas.train import dist

    one = dist.setup("cpu")                   # one process: no group, every collective a no-op
    assert (one.rank, one.world, one.device, one.owns_group) == (0, 1, torch.device("cpu"), False)
    assert dist.any_rank(True, one.device) and not dist.any_rank(False, one.device)
    assert dist.gather_lists(["x"]) == ["x"]

    mp.spawn(_dist_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        seen = json.loads((tmp_path / f"r{r}.json").read_text())
        assert seen == {"rank": r, "world": 2, "owns": True, "any_1": True, "any_none": False,
                        "gathered": ["r0", "r1", "r1"], "after_teardown": False}


def test_evaluate_with_fixed_size_row_sets_equals_boolean_selection(tmp_path, monkeypatch):
    """evaluate() gathers the counted positions into row sets of the host-known bound (no host sync inside the
    forward), as training does; its metrics equal those of exact boolean selection."""
    from eyas.train import ttt

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    tr = Trainer(cfg(tmp_path, store, "e", steps=2, eval_fraction=0.3, device="cpu"), target=t)
    tr.train_step(tr.next_batch())
    bounds = []
    real = ttt._select
    monkeypatch.setattr(ttt, "_select", lambda m, n: (bounds.append(n), real(m, n))[1])
    fixed = tr.evaluate()
    assert bounds and all(n is not None for n in bounds)           # the bounded path ran
    monkeypatch.setattr(ttt, "_select", lambda m, n: real(m, None))
    exact = tr.evaluate()
    assert set(fixed) == set(exact) and fixed["positions_k"][0] > 0
    for key in fixed:  # counts and accuracies exactly; losses and mean alpha to float rounding (other chunk sums)
        if key.startswith(("loss", "alpha")):
            assert fixed[key] == pytest.approx(exact[key], rel=1e-6), key
        else:
            assert fixed[key] == exact[key], key
