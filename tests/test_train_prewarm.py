"""Training's warm-up during `eyas run`'s prepare (eyas/train/prewarm.py): the synthetic data fills the trainer's
packed steps and its eval split, the warm-up runs beside prepare and is done before training, it changes nothing the
run writes, a failed one costs a log line, and the compiled graphs it leaves are the ones training then loads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.train import prewarm
from eyas.train.data import epoch_batches, is_eval
from test_bench_prewarm import _alive
from test_run import tiny_run_inputs  # noqa: F401 - the tiny target and chats of test_run's pipeline

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


@pytest.mark.parametrize("max_len,batch_tokens,fraction", [(2048, 32768, 0.05), (160, 512, 0.05), (64, 100, 0.0)])
def test_synthetic_samples_fill_the_packed_steps_and_the_eval_split(max_len, batch_tokens, fraction):
    samples = prewarm.synthetic_samples(1000, max_len, fraction, batch_tokens)
    held = [s for s in samples if is_eval(s[0], fraction)]
    train = [s for s in samples if not is_eval(s[0], fraction)]
    assert (len(held) >= 1) == (fraction > 0) and len(held) <= 2
    assert all(len(ids) == len(mask) == max_len // 2 and all(0 <= t < 1000 for t in ids) and any(mask)
               for _, ids, mask in samples)
    packed = (max(1, batch_tokens // max_len), max_len)
    plan = epoch_batches(list(range(len(train))), [max_len // 2] * len(train), batch_tokens=batch_tokens, seed=0,
                         epoch=0, packed=packed)
    assert len(plan) >= prewarm.STEPS


def _cfg(root, out, **over):
    from test_run import _cfg as run_cfg

    return run_cfg(root, out, **{"run.capture": False, "run.online": True, "run.prewarm_train": True, **over})


def test_run_warms_training_during_prepare_and_writes_the_same_run(tiny_run_inputs, tmp_path, monkeypatch):
    """The warm-up process runs while prepare does (its pid in run.json), ends before the train stage with the
    trainer's start-up recorded, and the run it precedes trains exactly as one without it; the knob is not part of
    the run's identity."""
    import eyas.run as run_mod
    from eyas.run import run_pipeline

    real_prepare, seen = run_mod.STAGE_FUNCS["prepare"], []

    def prepare(cfg, c, run, target, redo=False):
        pid = json.loads((run / "run.json").read_text())["train_prewarm"]["pid"]
        seen.append((pid, _alive(pid)))
        return real_prepare(cfg, c, run, target, redo=redo)

    monkeypatch.setitem(run_mod.STAGE_FUNCS, "prepare", prepare)
    warmed = run_pipeline(_cfg(tiny_run_inputs, tmp_path / "warm", **{"run.prewarm_bench": False}))
    tp = warmed["train_prewarm"]
    assert seen == [(tp["pid"], True)] and tp["returncode"] == 0 and not _alive(tp["pid"])
    assert tp["startup"]["first_step_s"] > 0 and "finished_before_train" in tp and tp["samples"] > 0
    assert (tmp_path / "warm" / "logs" / "train-prewarm.log").exists()
    assert not (tmp_path / "warm" / "logs" / "train-prewarm").exists()   # its scratch data and drafter: removed
    monkeypatch.setitem(run_mod.STAGE_FUNCS, "prepare", real_prepare)
    plain = run_pipeline(_cfg(tiny_run_inputs, tmp_path / "plain", **{"run.prewarm_bench": False,
                                                                     "run.prewarm_train": False}))
    assert "train_prewarm" not in plain
    assert warmed["stages"]["train"]["summary"] == plain["stages"]["train"]["summary"]
    assert _cfg(tiny_run_inputs, tmp_path).identity() == \
        _cfg(tiny_run_inputs, tmp_path, **{"run.prewarm_train": False}).identity()


def test_no_warm_up_without_a_stage_to_overlap_or_for_offline_training(tiny_run_inputs, tmp_path):
    """Prepare done (a resumed run) or training from a store: nothing to overlap or nothing it warms, no process."""
    from eyas.run import RunConfig, run_pipeline

    run = tmp_path / "run"
    state = run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, run, **{"run.prewarm_train": False}).__dict__,
                                      "until": "prepare"}))
    assert "train_prewarm" not in state
    state = run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, run).__dict__, "until": "train"}))
    assert state["stages"]["train"]["done"] and "train_prewarm" not in state
    offline = run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, tmp_path / "off", **{
        "run.capture": True, "run.online": False}).__dict__, "until": "train"}))
    assert offline["stages"]["train"]["done"] and "train_prewarm" not in offline


def test_training_runs_when_the_warm_up_fails(tiny_run_inputs, tmp_path, monkeypatch):
    """A warm-up process that exits with an error costs one log line: training and the run finish."""
    from eyas.run import run_pipeline

    monkeypatch.setattr(prewarm, "command", lambda spec, result: [sys.executable, "-c", "import sys; sys.exit(3)",
                                                                  str(spec)])
    run = tmp_path / "run"
    state = run_pipeline(_cfg(tiny_run_inputs, run, **{"run.prewarm_bench": False}))
    tp = state["train_prewarm"]
    assert tp["returncode"] == 3 and "startup" not in tp and state["stages"]["export"]["done"]
    assert "train-prewarm: failed (exit status 3" in (run / "logs" / "run.log").read_text()


_TRAIN = """
import json, sys
from dataclasses import replace
from torch._dynamo.utils import counters
from eyas.target import load_target
from eyas.train.config import TrainConfig
from eyas.train.trainer import run_train
cfg = TrainConfig.from_dict(json.loads(open(sys.argv[1]).read())["train"])
run_train(replace(cfg, out=sys.argv[2]), load_target(cfg.target, device="cpu"))
print(json.dumps({k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}))
"""


def test_compiled_training_after_the_warm_up_compiles_nothing(tiny_run_inputs, tmp_path):
    """The warm-up's own process (`python -m eyas.train.prewarm`, as eyas run starts it) compiles a packed, compiled
    train config on its synthetic data; the real training after it, in a process of its own and on other data,
    finds every FX graph in the cache under $EYAS_CACHE/inductor (hits, no misses). Both are fresh processes with
    one thread each: on the CPU inductor's cache key includes the thread count, and a test process carries the
    global state earlier tests left."""
    import os
    from dataclasses import replace

    from eyas.run import resolve_stages, run_pipeline

    over = {"train.compile": True, "train.pack": "on", "train.ttt_steps": 2, "run.prewarm_train": False}
    cfg = _cfg(tiny_run_inputs, tmp_path / "run", **over)
    run_pipeline(replace(cfg, until="prepare"))
    train = resolve_stages(cfg, tmp_path / "run", vocab_size=None, progress=False).train
    spec = {"target": cfg.target, "device": "cpu", "dtype": "fp32", "train": train.to_dict(),
            "root": str(tmp_path / "warm"), "parent": os.getpid(), "nice": 0}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "EYAS_CACHE": str(tmp_path / "c")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    subprocess.run([sys.executable, "-m", "eyas.train.prewarm", str(tmp_path / "spec.json"),
                    str(tmp_path / "result.json")], env=env, check=True, timeout=900)
    warm = json.loads((tmp_path / "result.json").read_text())
    assert warm["compile_cache"]["fx_graph_misses"] > 0
    assert warm["compile_cache"]["dir"] == str(tmp_path / "c" / "inductor")
    out = subprocess.run([sys.executable, "-c", _TRAIN, str(tmp_path / "spec.json"), str(tmp_path / "train")],
                         env=env, check=True, timeout=900, capture_output=True, text=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen.get("fxgraph_cache_miss", 0) == 0
    assert seen.get("fxgraph_cache_hit", 0) >= warm["compile_cache"]["fx_graph_misses"]
