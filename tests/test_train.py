"""Trainer properties: offline == online features and loss, resume equality, DDP == single process, NaN naming,
refusals (store/target mismatch, empty data, other config on --resume), frequency baseline == TTT's step-0 rule."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.models import make_tiny_llama
from eyas.capture.capture import CaptureConfig, run_capture
from eyas.errors import EyasError
from eyas.target import target_from_model
from eyas.train.config import TrainConfig
from eyas.train.trainer import run_train

V = 96


def tiny_target(**kw):
    return target_from_model(make_tiny_llama(layers=4, hidden=32, heads=4, kv_heads=2, vocab=V, inter=64, **kw))


def make_samples(n=40, seed=1, masked=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(6, 30, (1,), generator=g))
        ids = torch.randint(3, V, (L,), generator=g).tolist()
        mask = [0] * (L // 3) + [1] * (L - L // 3) if masked else [0] * L
        if masked and L > 10:
            mask[L // 2] = 0                                     # a hole inside the assistant span
        out.append((f"s{i}", ids, mask))
    return out


def capture(tmp_path, target, samples, name="store"):
    run_capture(CaptureConfig(out=str(tmp_path / name), progress=False), target, samples=samples)
    return str(tmp_path / name)


def cfg(tmp_path, store, name="run", **kw):
    base = dict(out=str(tmp_path / name), store=store, steps=6, batch_tokens=96, draft_vocab=64, ttt_steps=3,
                eval_fraction=0.2, progress=False, deterministic=True, lr=1e-3)
    return TrainConfig(**{**base, **kw})


def records(run, split="train"):
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    keys = ("step", "loss", "loss_k", "acc_k", "cond_acc_k", "lr", "grad_norm", "positions_k", "round_tau_by_chain",
            "round_tau_first_by_chain")
    return [{k: r.get(k) for k in keys} for r in lines if r["split"] == split]


def prepared(path, target, samples):
    """A prepared-data directory of `samples` (id, ids, mask), recorded for `target`: online training's input."""
    from eyas.data.prepared import PreparedWriter, Sample

    w = PreparedWriter(path, identity={"test": 1})
    for sid, ids, m in samples:
        w.add(Sample(sid, ids, m))
    w.commit(len(samples), {})
    w.finish({"target": target.fingerprint, "counts": {"kept": len(samples)}})
    return path


def drafter_state(run):
    from safetensors.torch import load_file
    return load_file(os.path.join(run, "drafter", "model.safetensors"))


# ------------------------------------------------------------------------------- offline vs online
def test_online_features_match_hidden_states_and_store(tmp_path):
    from eyas.data.prepared import PreparedData, PreparedWriter, Sample
    from eyas.store.reader import Store
    from eyas.train.data import PreparedSource, StoreSource, target_features
    from eyas.train.trainer import TTTModule
    from eyas.train.ttt import TTTConfig
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    t = tiny_target()
    samples = make_samples(12)
    store = capture(tmp_path, t, samples)
    w = PreparedWriter(tmp_path / "prep", identity={"test": 1})
    for sid, ids, m in samples:
        w.add(Sample(sid, ids, m))
    w.commit(len(samples), {})
    w.finish({"target": t.fingerprint, "counts": {"kept": len(samples)}})

    off = StoreSource(Store(store, target=t), max_len=64)
    on = PreparedSource(PreparedData(tmp_path / "prep", target=t), max_len=64)
    want = ("s3", "s0", "s7")
    bo = off.collate([off.ids.index(s) for s in want])
    bn = target_features(t, on.collate([on.ids.index(s) for s in want]))
    assert bo.ids == bn.ids == list(want)
    for k in ("input_ids", "loss_mask", "valid"):
        assert torch.equal(getattr(bo, k), getattr(bn, k)), k

    # Naive reference for the online hooks: output_hidden_states of the full model, row by row (no padding).
    for r, sid in enumerate(want):
        ids = torch.tensor([samples[int(sid[1:])][1]])
        n = ids.shape[1]
        with torch.no_grad():
            o = t.model(ids, output_hidden_states=True)
        hs = o.hidden_states
        ref_aux = torch.cat([hs[j] for j in t.aux_layer_ids], -1)[0]        # (n, 3h)
        torch.testing.assert_close(bn.aux[r, :n], ref_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bn.final[r, :n], hs[-1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t.lm_head(bn.final[r, :n]), o.logits[0], rtol=1e-4, atol=1e-4)

    # The store holds bf16; the online features rounded the same way are bit-identical on valid positions.
    v = bo.valid
    assert torch.equal(bo.aux[v], bn.aux[v].bfloat16().float())
    assert torch.equal(bo.final[v], bn.final[v].bfloat16().float())

    # ... and the training loss module gives the same loss on both (after zeroing the padding).
    bn.aux, bn.final = bn.aux.bfloat16().float() * v[..., None], bn.final.bfloat16().float() * v[..., None]
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(t.config, draft_vocab_size=V, aux_layer_ids=t.aux_layer_ids))
    m = TTTModule(d, TTTConfig(num_steps=3))
    ew, lw = t.embed_tokens.weight, t.lm_head.weight
    lo = m(bo.input_ids, bo.loss_mask, bo.valid, bo.aux, bo.final, ew, lw)
    ln = m(bn.input_ids, bn.loss_mask, bn.valid, bn.aux, bn.final, ew, lw)
    assert lo[2][0] > 0
    for a, b in zip(lo, ln):
        assert torch.equal(a, b)


def test_online_run_matches_offline_run(tmp_path):
    """End to end through run_train: the same batches, counts and draft vocab; loss equal up to bf16 storage."""
    t = tiny_target()
    samples = make_samples(16)
    store = capture(tmp_path, t, samples)
    prepared(tmp_path / "prep", t, samples)
    a = run_train(cfg(tmp_path, store, "off", steps=1, eval_fraction=0.0), target=t)
    b = run_train(cfg(tmp_path, None, "on", data=str(tmp_path / "prep"), target="custom", steps=1,
                      eval_fraction=0.0), target=t)
    # Same batch, same positions counted; losses differ only by the bf16 rounding of the stored features.
    assert a["train"]["positions_k"] == b["train"]["positions_k"] and a["train"]["tokens"] == b["train"]["tokens"]
    assert abs(a["train"]["loss"] - b["train"]["loss"]) < 1e-2 * abs(b["train"]["loss"])


# ------------------------------------------------------------------------------------------ resume
class Crash(Exception):
    pass


def crashed_run(monkeypatch, run, step: int = 6):
    """run() with MetricsSink.log raising Crash right after it logs train step `step` (a kill between
    checkpoints); the sink is restored afterwards."""
    from eyas.train import metrics
    orig = metrics.MetricsSink.log

    def crashing_log(self, rec):
        orig(self, rec)
        if rec["step"] == step and rec["split"] == "train":
            raise Crash()
    monkeypatch.setattr(metrics.MetricsSink, "log", crashing_log)
    with pytest.raises(Crash):
        run()
    monkeypatch.setattr(metrics.MetricsSink, "log", orig)


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    full = run_train(cfg(tmp_path, store, "full", steps=8, checkpoint_every=4), target=t)
    crashed_run(monkeypatch, lambda: run_train(cfg(tmp_path, store, "cut", steps=8, checkpoint_every=4), target=t))
    assert len(records(tmp_path / "cut")) == 6            # the interrupted run logged past its checkpoint
    resumed = run_train(cfg(tmp_path, store, "cut", steps=8, checkpoint_every=4, resume=True), target=t)

    a, b = records(tmp_path / "full"), records(tmp_path / "cut")
    assert len(a) == 8 and a == b                          # bitwise: same floats in the JSON
    assert records(tmp_path / "full", "eval") == records(tmp_path / "cut", "eval")
    sa, sb = drafter_state(tmp_path / "full"), drafter_state(tmp_path / "cut")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert full["eval"] == resumed["eval"]


def test_deterministic_training_leaves_the_process_as_it_was(tmp_path):
    """A deterministic run turns on torch's deterministic algorithms for itself only: what runs after it in the same
    process (eyas run's bench; the next test) gets the switches back as they were."""
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(20))
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    try:
        for state in ((False, True), (True, False)):
            torch.use_deterministic_algorithms(state[0])
            torch.backends.cudnn.benchmark = state[1]
            run_train(cfg(tmp_path, store, f"run-{state[0]}", steps=2), target=t)
            assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == state
            # a run refused after its set-up (the vocabulary check comes after dist.setup) gives them back too
            with pytest.raises(EyasError, match="larger than the target's vocabulary"):
                run_train(cfg(tmp_path, store, f"refused-{state[0]}", draft_vocab=10**6), target=t)
            assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == state
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def test_loss_on_all_trains_prompt_positions_and_evaluates_on_the_mask(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples())
    a = run_train(cfg(tmp_path, store, "asst", steps=1), target=t)
    b = run_train(cfg(tmp_path, store, "all", steps=1, loss_on="all"), target=t)
    # The same first batch: every position the loss mask counts is counted, plus the prompt positions.
    pa, pb = records(tmp_path / "asst")[0]["positions_k"], records(tmp_path / "all")[0]["positions_k"]
    assert all(y > x > 0 for x, y in zip(pa, pb))
    assert records(tmp_path / "asst")[0]["loss"] != records(tmp_path / "all")[0]["loss"]
    # Evaluation always counts the loss-mask positions only.
    assert a["eval"]["positions_k"] == b["eval"]["positions_k"]
    with pytest.raises(ValueError, match="loss_on"):
        cfg(tmp_path, store, "bad", loss_on="prompt")


def test_resume_refuses_other_config_and_fresh_run_refuses_existing(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(24))
    run_train(cfg(tmp_path, store, "r", steps=2), target=t)
    with pytest.raises(EyasError, match=r"lr: 0\.001 != 0\.002"):
        run_train(cfg(tmp_path, store, "r", steps=2, lr=2e-3, resume=True), target=t)
    with pytest.raises(EyasError, match="--resume"):
        run_train(cfg(tmp_path, store, "r", steps=2), target=t)


# --------------------------------------------------------------------------------------------- DDP
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, kw):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from eyas.cli import leave

    try:
        run_train(TrainConfig(**kw), target=tiny_target())
    finally:
        dist.destroy_process_group()
    leave(0)  # as `eyas train` under torchrun: no interpreter teardown, where FSDP2's kept gloo group can abort


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ddp", "fsdp2"])
def test_ddp_two_ranks_equals_single_process(tmp_path, fsdp):
    """2 gloo ranks x grad_accum 1 == 1 process x grad_accum 2 on the same global batches (DDP, or FSDP2)."""
    import torch.multiprocessing as mp

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    single = cfg(tmp_path, store, "single", steps=3, grad_accum=2, deterministic=False)
    run_train(single, target=t)
    kw = {**single.to_dict(), "out": str(tmp_path / "ddp"), "grad_accum": 1, "fsdp": fsdp}
    mp.spawn(_ddp_worker, args=(2, _free_port(), kw), nprocs=2, join=True)

    a, b = records(tmp_path / "single"), records(tmp_path / "ddp")
    assert [r["positions_k"] for r in a] == [r["positions_k"] for r in b]   # same global batches
    for ra, rb in zip(a, b):
        assert ra["acc_k"] == rb["acc_k"]
        assert abs(ra["loss"] - rb["loss"]) < 1e-5 and abs(ra["grad_norm"] - rb["grad_norm"]) < 1e-5
    sa, sb = drafter_state(tmp_path / "single"), drafter_state(tmp_path / "ddp")
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5)  # 3 Adam steps apart
    ea, eb = records(tmp_path / "single", "eval")[0], records(tmp_path / "ddp", "eval")[0]
    assert ea["positions_k"] == eb["positions_k"]
    # the replayed decoding tau (metrics.round_counts) is summed over ranks like every other eval count
    assert len(ea["round_tau_by_chain"]) == len(ea["acc_k"]) and all(t >= 1.0 for t in ea["round_tau_by_chain"])
    assert ea["round_tau_by_chain"] == pytest.approx(eb["round_tau_by_chain"], rel=1e-9)
    assert ea["round_tau_first_by_chain"] == pytest.approx(eb["round_tau_first_by_chain"], rel=1e-9)


@pytest.mark.slow
def test_eyas_train_fsdp_under_torchrun_exits_0_with_whole_outputs(tmp_path):
    """`torchrun --nproc_per_node 2 -m eyas train --fsdp` (gloo on the CPU, online from a prepared directory): both
    ranks leave by eyas.cli.leave (no interpreter teardown, where FSDP2's cached group could abort a rank) and exit 0,
    and nothing written is lost to it: the metrics, the TensorBoard events and the final drafter are whole and equal
    to one process's with 2 micro-batches a step."""
    from test_faults import _cli_target_and_data

    tdir, prep, _ = _cli_target_and_data(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1",
           "EYAS_CACHE": str(tmp_path / "c")}
    args = ["-m", "eyas", "train", "--data", str(prep), "--target", str(tdir), "--steps", "4", "--batch-tokens", "64",
            "--lr", "0.01", "--device", "cpu", "--no-progress"]
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            *args, "--out", str(tmp_path / "ranks"), "--fsdp"],
                           capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert ranks.returncode == 0 and "terminate called" not in ranks.stderr, ranks.stderr[-3000:]
    one = subprocess.run([sys.executable, *args, "--out", str(tmp_path / "one"), "--grad-accum", "2"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = records(tmp_path / "ranks"), records(tmp_path / "one")
    assert [r["step"] for r in a] == [1, 2, 3, 4] and a[-1]["loss"] < a[0]["loss"]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) < 1e-5 and ra["acc_k"] == rb["acc_k"]
    assert records(tmp_path / "ranks", "eval")[-1]["step"] == 4
    assert [f.stat().st_size > 0 for f in (tmp_path / "ranks" / "tb").iterdir()] == [True]
    sa, sb = drafter_state(tmp_path / "ranks"), drafter_state(tmp_path / "one")
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------- bad input
def _store_with(tmp_path, t, samples, bad=None):
    from eyas.store.writer import StoreWriter
    h = t.hidden_size
    header = {"target": t.fingerprint, "layers": {"aux": list(t.aux_layer_ids)}, "dtype": "bf16",
              "hidden_size": h, "vocab_size": V, "data": {"source": "test"}, "config": {"target": "custom"}}
    w = StoreWriter(tmp_path / "nanstore", header=header)
    for sid, ids, m in samples:
        aux, final = torch.randn(len(ids), 3, h), torch.randn(len(ids), h)
        if sid == bad:
            aux[len(ids) // 2, 1, 3] = float("nan")
        w.add_sample(sid, ids, m, aux, final)
    w.close()
    w.finalize({s[0] for s in samples})
    return str(tmp_path / "nanstore")


def test_nan_in_features_names_sample_and_step(tmp_path):
    t = tiny_target()
    samples = make_samples(30)
    store = _store_with(tmp_path, t, samples, bad="s17")
    with pytest.raises(EyasError, match=r"step \d+: NaN/Inf in features, sample\(s\) 's17'"):
        run_train(cfg(tmp_path, store, steps=50, eval_fraction=0.0), target=t)


def test_nan_between_logged_steps_is_named_before_anything_is_saved(tmp_path):
    """Steps between log steps read nothing back from the device; their NaN checks are read at the next logged
    step, eval or checkpoint. The error names the same step and sample as a run that checks every step, and no
    checkpoint of that step or a later one is written."""
    t = tiny_target()
    store = _store_with(tmp_path, t, make_samples(30), bad="s17")
    msgs = []
    for name, every in (("each", 1), ("sparse", 7)):
        with pytest.raises(EyasError) as e:
            run_train(cfg(tmp_path, store, name, steps=50, eval_fraction=0.0, log_every=every, checkpoint_every=5),
                      target=t)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "NaN/Inf in features, sample(s) 's17'" in msgs[0]
    bad = int(msgs[0].split()[1].rstrip(":"))
    saved = [int(p.name.split("-")[1]) for p in (tmp_path / "sparse" / "checkpoints").glob("step-*")]
    assert all(s < bad for s in saved), (bad, saved)
    assert bad % 5 and bad % 7, bad   # so the sparse run raised at a later step than the one it names
    metrics = tmp_path / "sparse" / "metrics.jsonl"
    logged = [r["step"] for r in records(tmp_path / "sparse")] if metrics.exists() else []
    assert all(s % 7 == 0 and s < bad for s in logged), (bad, logged)


def test_sparse_logging_trains_the_same_drafter(tmp_path):
    """log_every only changes which steps are read back: the weights, the logged steps' records and the tokens
    seen are those of a run that reads every step. The last step (8, not a multiple of log_every) is logged too,
    and the returned train summary is that step's."""
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(24))
    run_train(cfg(tmp_path, store, "each", steps=8, log_every=1), target=t)
    result = run_train(cfg(tmp_path, store, "sparse", steps=8, log_every=3), target=t)
    each, sparse = records(tmp_path / "each"), records(tmp_path / "sparse")
    assert [r["step"] for r in sparse] == [3, 6, 8]
    assert [r for r in each if r["step"] % 3 == 0 or r["step"] == 8] == sparse
    assert result["step"] == 8
    # the start-up (the preset's first steps end minutes in): Trainer() and the first step, compiles included; in
    # the manifest, not the result (a result is the training's outcome, equal between equal runs)
    startup = json.loads((tmp_path / "sparse" / "manifest.json").read_text())["startup"]
    assert set(startup) == {"setup_s", "first_step_s"} and all(v > 0 for v in startup.values())
    assert {k: result["train"][k] for k in ("loss", "loss_k", "acc_k")} == {k: sparse[-1][k] for k in
                                                                          ("loss", "loss_k", "acc_k")}
    full = [json.loads(x) for x in open(tmp_path / "each" / "metrics.jsonl") if '"train"' in x]
    assert sum(r["tokens"] for r in full) == full[-1]["tokens_seen"]
    sa, sb = drafter_state(tmp_path / "each"), drafter_state(tmp_path / "sparse")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_inf_gradient_norm_names_its_step(tmp_path):
    """Finite features and loss, but an infinite gradient at step 4 (a backward hook adds +inf): training stops
    there, naming the step and its samples, before the poisoned update reaches a checkpoint or the drafter."""
    from eyas.train.trainer import Trainer
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(30))
    tr = Trainer(cfg(tmp_path, store, steps=6, eval_fraction=0.0, checkpoint_every=1), target=t)
    tr.params[0].register_hook(lambda g: g + float("inf") if tr.step + 1 == 4 else g)
    names = ", ".join(repr(tr.source.ids[j]) for idx in tr.plan(0)[3] for j in idx)
    with pytest.raises(EyasError) as e:
        tr.train()
    assert str(e.value) == f"step 4: NaN/Inf in gradient norm, sample(s) {names}"
    saved = [int(p.name.split("-")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step-*")]
    assert max(saved) == 3, saved
    assert not (tmp_path / "run" / "drafter").exists()


def test_store_target_mismatch_refused(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(8))
    other = target_from_model(make_tiny_llama(layers=6, hidden=32, heads=4, kv_heads=2, vocab=V, inter=64))
    with pytest.raises(EyasError, match="target does not match"):
        run_train(cfg(tmp_path, store), target=other)
    relayered = target_from_model(t.model, aux_layer_ids=(0, 2, 3))
    with pytest.raises(EyasError, match=r"aux layers \[1, 2, 3\] != the target's \[0, 2, 3\]"):
        run_train(cfg(tmp_path, store, "r2"), target=relayered)


def test_empty_or_fully_masked_data_refused(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(10, masked=False))
    with pytest.raises(EyasError, match="no trainable"):
        run_train(cfg(tmp_path, store, eval_fraction=0.0), target=t)
    store2 = capture(tmp_path, t, [("a", [5, 6], [1, 1])], name="short")
    with pytest.raises(EyasError, match="no training samples"):
        run_train(cfg(tmp_path, store2, "r2"), target=t)


# ------------------------------------------------------------------------------------ baseline
def test_frequency_baseline_counts_ttt_step0_positions():
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from eyas.train.metrics import frequency_baseline
    from eyas.train.ttt import TTTConfig, ttt_forward

    torch.manual_seed(0)
    t = tiny_target()
    B, T, h = 3, 20, t.hidden_size
    ids = torch.randint(0, V, (B, T))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, 15:] = False
    valid[2, 7] = False                                    # a hole
    lm = torch.rand(B, T) > 0.3
    final = torch.randn(B, T, h)
    cfgd = DrafterConfig.from_target(t.config, draft_vocab_size=40, aux_layer_ids=t.aux_layer_ids)
    d = Eagle3Drafter(cfgd)
    tok = torch.arange(0, 80, 2)                           # every even id
    d2t, t2d = tok - torch.arange(40), torch.zeros(V, dtype=torch.bool)
    t2d[tok] = True
    d.set_vocab(d2t, t2d)
    o = ttt_forward(d, input_ids=ids, loss_mask=lm, valid=valid, aux=torch.randn(B, T, 3 * h), final=final,
                    embed=t.embed_tokens, lm_head_weight=t.lm_head.weight, cfg=TTTConfig(num_steps=2))
    tgt = (final @ t.lm_head.weight.T).argmax(-1)
    top = int(tgt[0, 3]) if t2d[tgt[0, 3]] else int(tok[0])
    count, correct = frequency_baseline(ids, lm, valid, final, t.lm_head.weight, t2d, top)
    assert int(count) == int(o.count_k[0]) > 0
    # naive: loop over positions with the rule written out
    n_ok = 0
    for b in range(B):
        for s in range(1, T - 1):
            if valid[b, s - 1] and valid[b, s] and valid[b, s + 1] and lm[b, s + 1] and t2d[tgt[b, s]]:
                n_ok += int(tgt[b, s]) == top
    assert int(correct) == n_ok


def test_cli_train_writes_run_layout(tmp_path, capsys):
    import argparse
    from eyas.train.command import register
    from eyas.model.checkpoint import load_drafter
    from eyas.model.vocab import load_draft_vocab
    from eyas.manifest import read_manifest

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(24))
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    args = p.parse_args(["train", "--store", store, "--out", str(tmp_path / "run"), "--steps", "2",
                         "--batch-tokens", "96", "--draft-vocab", "50", "--ttt-steps", "2", "--no-progress"])
    # the CLI would load the store's target by name ("custom"): hand it the object instead
    import eyas.train.trainer as tr
    orig = tr._open_source
    tr._open_source = lambda c, target, device: orig(c, t, device)
    try:
        assert args.func(args) == 0
    finally:
        tr._open_source = orig
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 2
    m = read_manifest(tmp_path / "run", kind="train")
    assert m["status"] == "complete" and m["target"] == t.fingerprint and m["config"]["draft_vocab"] == 50
    d, meta = load_drafter(tmp_path / "run" / "drafter")
    vocab = load_draft_vocab(tmp_path / "run" / "vocab" / "draft_vocab.safetensors")
    assert meta["target"] == t.fingerprint and torch.equal(d.d2t, vocab.d2t) and vocab.size == 50
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "state.pt").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_autocast_matches_cpu_fp32(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(24))
    a = run_train(cfg(tmp_path, store, "cpu", steps=1, eval_fraction=0.0, device="cpu", pack="off"), target=t)
    t.model.to("cuda")
    b = run_train(cfg(tmp_path, store, "gpu", steps=1, eval_fraction=0.0, device="cuda", deterministic=False,
                      pack="off"), target=t)
    assert a["train"]["positions_k"] == b["train"]["positions_k"]
    assert abs(a["train"]["loss"] - b["train"]["loss"]) < 2e-2 * abs(a["train"]["loss"])
    sa, sb = drafter_state(tmp_path / "cpu"), drafter_state(tmp_path / "gpu")
    for k in sa:  # one Adam step of lr 1e-3 from the same init: same signs almost everywhere
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=2.5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_flex_compiled_matches_packed_dense(tmp_path):
    """The GPU fast path (packed rows, flex attention, compiled layer) trains like the dense reference path on the
    same packed batches: same counts, same loss curve within bf16 noise."""
    t = target_from_model(make_tiny_llama(layers=4, hidden=64, heads=4, kv_heads=2, vocab=V, inter=96))
    store = capture(tmp_path, t, make_samples(48))
    t.model.to("cuda")
    kw = dict(steps=4, eval_fraction=0.2, device="cuda", deterministic=False, pack="on", max_len=32, batch_tokens=128)
    a = run_train(cfg(tmp_path, store, "dense", attention="dense", **kw), target=t)
    b = run_train(cfg(tmp_path, store, "fast", attention="flex", compile=True, **kw), target=t)
    assert a["train"]["positions_k"] == b["train"]["positions_k"] and a["eval"]["positions_k"] == b["eval"]["positions_k"]
    for ra, rb in zip(records(tmp_path / "dense"), records(tmp_path / "fast")):
        assert abs(ra["loss"] - rb["loss"]) < 2e-2 * abs(ra["loss"]), (ra, rb)


def test_flex_attention_is_refused_on_the_cpu_before_anything_is_written(tmp_path):
    """torch's flex_attention has no backward on the CPU: one line naming the fix, no run directory."""
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(12))
    with pytest.raises(EyasError, match=r"^train: --attention flex trains on CUDA only .* use auto, dense or blocks"):
        run_train(cfg(tmp_path, store, "run", attention="flex"), target=t)
    assert not (tmp_path / "run").exists()
