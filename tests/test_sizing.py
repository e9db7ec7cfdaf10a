"""Sizing a run to its budget (eyas.sizing): the estimate against a hand-written reference, and the choice.

The measurement itself runs on a real tiny pipeline in tests/test_run.py."""

import math
from pathlib import Path

import pytest

from eyas.run import RunConfig, resolve_stages
from eyas.sizing import MIN_BENCH_PROMPTS, MIN_CONVERSATIONS, RESERVE, Rates, choose, estimate

RATES = Rates(read_s_per_conversation=0.01, prefill_s_per_token=1e-3, decode_s_per_step=0.05,
              capture_s_per_token=1e-3, train_s_per_token=2e-3, bench_s_per_token=0.04, lossless_s_per_token=0.06,
              prompt_tokens=80.0, sample_tokens=300.0, regen_tokens=170.0, seconds=30.0)


def stages(**overrides):
    return resolve_stages(RunConfig(preset="cpu-demo", out="/tmp/unused", overrides=overrides), Path("/tmp/unused"),
                          vocab_size=49152)


def test_the_estimate_is_the_plans_work_at_the_measured_rates():
    s = stages()
    p, t, (b,) = s.prepare, s.train, s.bench.values()
    regen, rest = p.regen.regenerate_limit, p.limit - p.regen.regenerate_limit
    tokens = regen * 170.0 + rest * 300.0
    want = {
        # each conversation read and written, each regenerated prompt prefilled, and each batch of gen_batch rows
        # decoded for max_new_tokens steps
        "prepare": p.limit * 0.01 + regen * 80.0 * 1e-3
        + math.ceil(regen / p.regen.gen_batch) * p.regen.max_new_tokens * 0.05,
        "capture": tokens * 1e-3,
        "train": t.epochs * tokens * 2e-3,
        # the drafter, plain and prompt lookup on each prompt; the first lossless_turns again in fp32, twice
        "bench": b.limit * b.max_turns * b.max_new_tokens * 3 * 0.04 + b.lossless_turns * b.max_new_tokens * 2 * 0.06,
    }
    got = estimate(s, RATES)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k]), k


def test_a_plan_that_fits_is_run_as_written():
    s = stages()
    fits = (sum(estimate(s, RATES).values()) + 61) / (1 - RESERVE)
    plan = choose(s, RATES, budget_s=fits, spent_s=60, fixed=set(), bench_tables=1)
    assert plan.scale == 1.0 and plan.overrides == {}


def test_a_plan_that_does_not_fit_shrinks_to_the_largest_that_does():
    s = stages()
    budget, spent = 1200.0, 60.0
    plan = choose(s, RATES, budget, spent_s=spent, fixed=set(), bench_tables=1)
    assert set(plan.overrides) == {"prepare.limit", "prepare.regenerate_limit", "bench.0.limit"}
    sized = stages(**plan.overrides)
    left = budget * (1 - RESERVE) - spent      # a share of the budget is kept free
    assert sum(estimate(sized, RATES).values()) <= left
    assert plan.estimate == pytest.approx(estimate(sized, RATES))
    # one more percent of the data would not fit
    bigger = stages(**{"prepare.limit": round(plan.overrides["prepare.limit"] * 1.01) + 1,
                       "prepare.regenerate_limit": round(plan.overrides["prepare.regenerate_limit"] * 1.01) + 1})
    assert sum(estimate(bigger, RATES).values()) > left
    assert plan.overrides["prepare.limit"] < s.prepare.limit and 0 < plan.scale < 1


def test_what_the_user_set_is_kept_and_the_floors_hold():
    s = stages(limit=900)
    plan = choose(s, RATES, 1200.0, spent_s=60, fixed={("prepare", "limit")}, bench_tables=1)
    assert "prepare.limit" not in plan.overrides and "prepare.regenerate_limit" in plan.overrides
    # a budget nothing fits: the smallest plan, not an empty one
    plan = choose(stages(), RATES, 10.0, spent_s=60, fixed=set(), bench_tables=1)
    assert plan.overrides["prepare.limit"] == MIN_CONVERSATIONS
    assert plan.overrides["bench.0.limit"] == MIN_BENCH_PROMPTS and plan.overrides["prepare.regenerate_limit"] >= 1


def test_bench_prompts_are_left_alone_when_the_tables_do_not_map_one_to_one():
    plan = choose(stages(), RATES, 1200.0, spent_s=60, fixed=set(), bench_tables=2)
    assert not any(k.startswith("bench.") for k in plan.overrides)
