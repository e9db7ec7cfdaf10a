"""benchmarks/levers.py: the `eyas train` command written for each lever reproduces the config it trained with, and
the table compares every lever with its job's base row."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from eyas.knobs import from_args
from eyas.train.config import TrainConfig

spec = importlib.util.spec_from_file_location("levers", Path(__file__).parents[1] / "benchmarks" / "levers.py")
levers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(levers)


def _resolved(overrides: dict) -> TrainConfig:
    _, c = levers.stages("smollm2-135m", overrides, Path("/tmp/levers-test"), 49152)
    return replace(c.train, data="/tmp/prepared", steps=300, epochs=None, eval_every=300, checkpoint_every=0,
                   progress=False)


@pytest.mark.parametrize("name", ["base", "lk_lambda", "nonorm", "all", "ttt7", "vocab16k", "init"])
def test_train_command_parses_back_to_the_lever_config(name):
    cfg = _resolved({k: v for k, v in levers.LEVERS[name].items() if k != "steps"})
    argv, not_flags = levers.train_flags(cfg)
    parsed = from_args(TrainConfig, levers._subparser("train").parse_args(argv))
    # every field equals the lever's, except the ones reported as not flags (they keep the CLI's defaults)
    for f in fields(TrainConfig):
        want = getattr(cfg, f.name)
        if f.name in not_flags:
            assert getattr(parsed, f.name) == f.default != want
        else:
            assert getattr(parsed, f.name) == want, f.name
    assert not_flags == {"log_every": 10}   # the gpu recipe's only value that `eyas train` has no flag for


def test_lever_flags_are_the_difference_from_base():
    base = levers.train_flags(_resolved({}))[0]
    assert levers._delta(base, levers.train_flags(_resolved({"train.loss": "lk_lambda"}))[0]) == "--loss lk_lambda"
    assert levers._delta(base, levers.train_flags(_resolved({"train.ttt_steps": 7}))[0]) == "--ttt-steps 7"
    assert levers._delta(base, levers.train_flags(_resolved({"train.norm_before_fc": False}))[0]) == \
        "without --norm-before-fc"   # the preset trains it: the lever turns it off
    assert levers._delta(base, base) == ""


def _row(name, tau, lookup=None, **kw):
    bench = {"eagle-chain": {"tau": tau, "tau_ci95": [tau - 0.2, tau + 0.2]}}
    if lookup:
        bench["lookup"] = {"tau": lookup}
    return {"lever": name, "flags": kw.get("flags", "(the preset's)"), "steps": 300, "train_s": 100.0,
            "bench_s": 40.0, "tokens_per_s": 110000.0,
            "eval": {"acc_k": [0.8, 0.7], "round_tau_first_by_chain": [1.8, 2.3, 2.7, 3.0, 3.2]},
            "bench": bench, "device": "gpu", "torch": "2.11", "train_command": "eyas train X",
            "bench_command": "eyas bench Y", "not_flags": {"log_every": 10}, "bench_records": 60}


def test_table_compares_with_the_base_row_in_run_order(tmp_path):
    for r in (_row("base", 3.0, lookup=2.0), _row("norm", 3.3, flags="--norm-before-fc"), _row("ttt7", 2.7)):
        (tmp_path / r["lever"]).mkdir()
        (tmp_path / r["lever"] / "row.json").write_text(json.dumps(r))
    (tmp_path / "order").write_text("base norm all ttt7\n")   # `all` has not finished: no row
    md = levers.table(levers.rows_of(tmp_path))
    body = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| lever")]
    assert [ln.split("|")[1].strip() for ln in body] == ["base", "norm", "ttt7"]
    assert [ln.split("|")[-2].strip() for ln in body] == ["1.000x", "1.100x", "0.900x"]
    assert "| 3.300 (3.10-3.50) |" in body[1] and "`--norm-before-fc`" in body[1]
    assert "| 3.20 |" in body[0]                      # the eval's replayed chain-5 tau, first replies
    assert "tau 2.00; base / lookup 1.500x" in md


@pytest.mark.parametrize("compile", [False, True])
def test_lever_bench_builds_with_and_without_compile(compile):
    # the preset persists its compiled steps; a lever benched without compiling must not ask for that
    _, c = levers.stages("smollm2-135m", {}, Path("/tmp/levers-test"), 49152)
    bc = levers.lever_bench(c, Path("/tmp/lv/base"), limit=60, compile=compile, baselines=False)
    assert (bc.compile, bc.persist_steps) == (compile, compile and c.bench[levers.BENCH].persist_steps)
    assert (bc.limit, bc.lossless_turns, bc.drafter) == (60, 0, "/tmp/lv/base/train")


def test_a_row_without_eval_takes_it_from_metrics(tmp_path):
    # a resumed run at its last step returns no eval; the table reads the last eval line of its metrics.jsonl
    row = {**_row("base", 3.0), "eval": {k: None for k in levers.EVAL_KEYS}}
    (tmp_path / "base" / "train").mkdir(parents=True)
    (tmp_path / "base" / "row.json").write_text(json.dumps(row))
    lines = [{"step": 150, "split": "eval", "acc_k": [0.1, 0.05]}, {"step": 300, "split": "train", "loss": 1.0},
             {"step": 300, "split": "eval", "acc_k": [0.4, 0.36]}]
    (tmp_path / "base" / "train" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    [got] = levers.rows_of(tmp_path)
    assert got["eval"]["acc_k"] == [0.4, 0.36]
    assert "| 0.400 0.360 |" in levers.table([got])
