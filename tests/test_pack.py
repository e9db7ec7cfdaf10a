"""Packed rows: placement, gather, and a packed training step equal to a padded one on the same samples."""

import torch

from eyas.train.data import Batch, epoch_batches, pack, pack_rows
from test_train import capture, cfg, make_samples, tiny_target


def test_pack_rows_first_fit_and_refusal():
    assert pack_rows([5, 3, 4, 2], rows=2, row_len=8) == [[0, 1], [2, 3]]
    assert pack_rows([5, 5, 5], rows=2, row_len=8) is None


def test_pack_moves_every_token_and_feature_once():
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5, 2, 6]
    B, T, h = len(lengths), max(lengths), 4
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    b = Batch([f"s{i}" for i in range(B)], torch.randint(1, 50, (B, T), generator=g) * valid,
              (torch.rand(B, T, generator=g) > 0.5) & valid, valid,
              torch.randn(B, T, 3 * h, generator=g), torch.randn(B, T, h, generator=g))
    p = pack(b, rows=3, row_len=9)
    assert p.input_ids.shape == (3, 9) and p.aux.shape == (3, 9, 3 * h)
    assert int(p.valid.sum()) == sum(lengths) and int((p.segment_ids > 0).sum()) == sum(lengths)
    plan = pack_rows(lengths, 3, 9)
    for r, members in enumerate(plan):
        at = 0
        for s, j in enumerate(members, start=1):
            n = lengths[j]
            assert torch.equal(p.input_ids[r, at:at + n], b.input_ids[j, :n])
            assert torch.equal(p.loss_mask[r, at:at + n], b.loss_mask[j, :n])
            assert torch.equal(p.aux[r, at:at + n], b.aux[j, :n]) and torch.equal(p.final[r, at:at + n], b.final[j, :n])
            assert p.segment_ids[r, at:at + n].eq(s).all() and p.position_ids[r, at:at + n].tolist() == list(range(n))
            at += n
        assert not p.valid[r, at:].any() and p.segment_ids[r, at:].eq(0).all()


def test_packed_epoch_covers_each_sample_once_and_fits():
    lengths = [int(x) for x in torch.randint(1, 40, (200,), generator=torch.Generator().manual_seed(3))]
    batches = epoch_batches(list(range(200)), lengths, batch_tokens=0, seed=1, epoch=0, packed=(4, 40))
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(pack_rows([lengths[i] for i in b], 4, 40) is not None for b in batches)
    # nearly full: first fit in random order wastes little
    assert sum(lengths) / (len(batches) * 4 * 40) > 0.8


def test_packed_training_step_equals_padded_step(tmp_path):
    """One step over the same 16 samples, padded rows vs packed rows (fp32): same counts, same loss, same
    weights after the update; and the online run (target features in length-sorted sub-batches) matches too."""
    from eyas.data.prepared import PreparedWriter, Sample
    from eyas.train.trainer import run_train
    from test_train import drafter_state

    t = tiny_target()
    samples = make_samples(16)
    store = capture(tmp_path, t, samples)
    kw = dict(steps=1, eval_fraction=0.0, batch_tokens=512, max_len=32)
    a = run_train(cfg(tmp_path, store, "padded", pack="off", **kw), target=t)
    b = run_train(cfg(tmp_path, store, "packed", pack="on", **kw), target=t)
    assert a["train"]["positions_k"] == b["train"]["positions_k"] and a["train"]["tokens"] == b["train"]["tokens"]
    assert abs(a["train"]["loss"] - b["train"]["loss"]) < 1e-5 * abs(a["train"]["loss"])
    sa, sb = drafter_state(tmp_path / "padded"), drafter_state(tmp_path / "packed")
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-6, msg=k)
    w = PreparedWriter(tmp_path / "prep", identity={"test": 1})
    for sid, ids, m in samples:
        w.add(Sample(sid, ids, m))
    w.commit(len(samples), {})
    w.finish({"target": t.fingerprint, "counts": {"kept": len(samples)}})
    c = run_train(cfg(tmp_path, None, "online", data=str(tmp_path / "prep"), target="custom", pack="on",
                      **{**kw, "batch_tokens": 96}), target=t)
    d = run_train(cfg(tmp_path, store, "offline96", pack="on", **{**kw, "batch_tokens": 96}), target=t)
    assert c["train"]["positions_k"] == d["train"]["positions_k"]
    assert abs(c["train"]["loss"] - d["train"]["loss"]) < 1e-2 * abs(d["train"]["loss"])
