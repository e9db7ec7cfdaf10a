"""Training knobs: the draft vocabulary bound, periodic held-out eval and the tokens-seen axis."""

import json

import pytest

from eyas.errors import EyasError
from eyas.train.trainer import run_train
from test_train import V, capture, cfg, make_samples, tiny_target


def test_draft_vocab_larger_than_target_is_refused_and_default_fits(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(16))
    with pytest.raises(EyasError, match=f"--draft-vocab {V + 1} is larger than the target's vocabulary \\({V}"):
        run_train(cfg(tmp_path, store, "big", draft_vocab=V + 1, steps=1), target=t)
    run_train(cfg(tmp_path, store, "default", draft_vocab=None, steps=1), target=t)
    summary = json.loads((tmp_path / "default" / "vocab" / "summary.json").read_text())
    assert summary["size"] == V                      # min(32000, V)


def test_eval_every_logs_held_out_points_on_the_tokens_seen_axis(tmp_path):
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))
    run_train(cfg(tmp_path, store, "r", steps=6, eval_every=2, eval_fraction=0.3), target=t)
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6]
    cum = 0
    by_step = {}
    for r in train:
        cum += r["tokens"]
        by_step[r["step"]] = cum
        assert r["tokens_seen"] == cum
    assert [r["tokens_seen"] for r in evals] == [by_step[2], by_step[4], by_step[6]]


def test_device_defaults_fill_what_is_left_open_and_say_so(tmp_path, capsys):
    """K and the draft vocabulary left None take the device's defaults (CPU: K=3, 8k), printed once and stored
    resolved, so a resume on the same device matches; explicit values are kept and nothing is printed."""
    from eyas.train.config import DEVICE_DEFAULTS

    t = tiny_target()
    store = capture(tmp_path, t, make_samples(16))
    capsys.readouterr()
    run_train(cfg(tmp_path, store, "auto", ttt_steps=None, draft_vocab=None, steps=2, checkpoint_every=1), target=t)
    err = capsys.readouterr().err
    assert "eyas train: on cpu: ttt_steps 3, draft_vocab 8192 (defaults for cpu; set them to change)" in err
    saved = json.loads((tmp_path / "auto" / "manifest.json").read_text())["config"]
    assert (saved["ttt_steps"], saved["draft_vocab"]) == (DEVICE_DEFAULTS["cpu"]["ttt_steps"], 8192)
    rows = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[0]["acc_k"]) == 3                # three TTT steps were trained
    # resuming with the same open fields resolves the same values and continues
    run_train(cfg(tmp_path, store, "auto", ttt_steps=None, draft_vocab=None, steps=2, resume=True), target=t)
    assert "ttt_steps 3, draft_vocab 8192" in capsys.readouterr().err
    run_train(cfg(tmp_path, store, "explicit", ttt_steps=2, draft_vocab=V, steps=1), target=t)
    assert "defaults for" not in capsys.readouterr().err


def test_evals_follow_eval_every_when_set_else_each_epoch_end(tmp_path):
    """eval_every N: held-out evals at multiples of N and after the last step, none extra at epoch ends (each eval is
    a full pass over the held-out split); eval_every 0: one at each epoch's end."""
    t = tiny_target()
    store = capture(tmp_path, t, make_samples(40))

    def eval_steps(name, **kw):
        run_train(cfg(tmp_path, store, name, epochs=3, steps=None, batch_tokens=256, eval_fraction=0.3, **kw), target=t)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        total = json.loads((tmp_path / name / "manifest.json").read_text())["total_steps"]
        return [r["step"] for r in rows if r["split"] == "eval"], total

    per_epoch, total = eval_steps("epochs", eval_every=0)
    e = total // 3
    assert total == 3 * e and e >= 2, total           # equal epochs of 2+ steps
    assert per_epoch == [e, 2 * e, 3 * e]
    every, total2 = eval_steps("every", eval_every=e + 1)  # an interval that misses the epoch ends
    assert total2 == total
    assert every == sorted(set(range(e + 1, total + 1, e + 1)) | {total}), every
    assert e not in every and 2 * e not in every
