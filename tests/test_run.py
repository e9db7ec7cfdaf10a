"""`eyas run`: the whole pipeline on a tiny target, resume by stage, redo of a corrupted stage, refusals."""

import json
import math
import random

import pytest

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.run import RunConfig, run_pipeline

WORDS = "the cat sat on a mat and then it ran to see what was there when all of us left home".split()


def _text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    from test_chat_masks import make_tokenizer

    root = tmp_path_factory.mktemp("run-inputs")
    tok = make_tokenizer()
    model = make_tiny_llama(layers=4, hidden=64, vocab=len(tok), max_pos=512)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rng = random.Random(0)
    with open(root / "chats.jsonl", "w") as f:
        for i in range(240):
            msgs = [{"role": "user", "content": _text(rng, 6)}, {"role": "assistant", "content": _text(rng, 10)}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return root


def _cfg(root, out, **over):
    knobs = dict(dtype="fp32", bench_dtype="fp32", autocast="off", limit=40, max_len=160, max_new_tokens=8, regen_batch=8, epochs=1, draft_vocab=64,
                 batch_tokens=512, bench=[dict(prompts="heldout", method="chain", k=3, limit=2, max_turns=1,
                                               max_new_tokens=8)])
    knobs.update(over)
    return RunConfig(target=str(root / "target"), data=str(root / "chats.jsonl"), preset="cpu-demo",
                     out=str(out), overrides=knobs, quiet=True)


def test_run_end_to_end_resume_and_redo(tiny_run_inputs, tmp_path, capsys):
    from eyas.model.importer import load_eagle3_checkpoint

    run = tmp_path / "run"
    # --until stops after a stage (time slices on a lent GPU); the next invocation picks up from there.
    cfg = _cfg(tiny_run_inputs, run, eval_every=1)
    state = run_pipeline(RunConfig(**{**cfg.__dict__, "until": "train"}))
    assert [s for s, v in state["stages"].items() if v["done"]] == ["prepare", "capture", "train"]
    assert not (run / "report.md").exists() and not (run / "bench").exists()
    state = run_pipeline(cfg)
    assert [s for s, v in state["stages"].items() if v["done"]] == ["prepare", "capture", "train", "bench", "export"]
    assert state["stages"]["prepare"]["summary"]["kept"] == 40
    bench = json.loads((run / "bench" / "heldout-chain3.json").read_text())
    assert bench["lossless"]["eagle-chain"]["held"]          # speculative output == plain greedy output
    assert set(bench["methods"]) == {"plain", "lookup", "eagle-chain"}
    report = (run / "report.md").read_text()
    for section in ("## Data", "## Training", "## Speculative decoding", "## Export", "vllm serve", "sglang"):
        assert section in report
    assert (run / "plots" / "loss.png").stat().st_size > 0 and (run / "plots" / "acceptance.png").exists()
    # the scaling curve: one held-out eval per step, at strictly growing token counts
    evals = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    seen = [m["tokens_seen"] for m in evals if m["split"] == "eval"]
    assert len(seen) == state["stages"]["train"]["summary"]["step"] >= 2 and seen == sorted(set(seen))
    assert "### Scaling" in report and (run / "plots" / "scaling.png").stat().st_size > 0
    assert "replayed round by round" in report and "each held-out sample's first reply only" in report
    drafter, _ = load_eagle3_checkpoint(run / "export")
    assert drafter.config.aux_layer_ids == (1, 2, 3)

    # A rerun skips every finished stage after verifying it.
    log = run / "logs" / "run.log"
    before = log.read_text()
    run_pipeline(_cfg(tiny_run_inputs, run, eval_every=1))
    new = log.read_text()[len(before):]
    for stage in ("prepare", "capture", "train", "bench", "export"):
        assert f"{stage}: done earlier" in new
    assert "starting" not in new

    # A corrupted stage output is detected on resume and that stage is redone.
    shard = next((run / "store").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = log.read_text()
    run_pipeline(_cfg(tiny_run_inputs, run, eval_every=1))
    new = log.read_text()[len(before):]
    assert "capture: its output failed verification on resume" in new and "capture: finished" in new
    from eyas.store.reader import Store
    Store(run / "store").verify()

    # Another configuration in the same directory is refused, naming what differs.
    with pytest.raises(EyasError, match="limit"):
        run_pipeline(_cfg(tiny_run_inputs, run, limit=41, eval_every=1))


def test_bad_presets_and_knobs():
    with pytest.raises(EyasError, match="unknown preset"):
        RunConfig(preset="turbo")
    with pytest.raises(EyasError, match="--until"):
        RunConfig(preset="cpu-demo", until="deploy")
    with pytest.raises(EyasError, match="--set learning_rate: unknown key"):
        RunConfig(preset="cpu-demo", overrides={"learning_rate": 1})
    # a knob of the wrong type is refused up front, naming the knob and the expected type
    for key, bad in (("limit", "many"), ("lr", "3e-3"), ("compile", 1), ("epochs", 2.5), ("bench", {"k": 3})):
        with pytest.raises(EyasError, match=f"--set {key}=.*expected"):
            RunConfig(preset="cpu-demo", overrides={key: bad})
    RunConfig(preset="cpu-demo", overrides={"lr": 1, "limit": None, "regen_dtype": "fp32"})   # int for float, None
    # the same with table-qualified keys
    for key, bad in (("prepare.limit", "many"), ("train.lr", "3e-3"), ("train.compile", 1), ("bench.0.k", 2.5)):
        with pytest.raises(EyasError, match=f"--set {key}=.*expected"):
            RunConfig(preset="cpu-demo", overrides={key: bad})
    RunConfig(preset="cpu-demo", overrides={"train.lr": 1, "prepare.limit": None, "prepare.regen_dtype": "fp32"})


def test_skipped_records_go_to_run_logs_and_verbose_prints_each(tiny_run_inputs, tmp_path, capsys):
    """A cold run prints one summary line for bad records; RUN/logs/skipped.jsonl has them all; --verbose prints
    each."""
    data = tmp_path / "chats.jsonl"
    lines = (tiny_run_inputs / "chats.jsonl").read_text().splitlines()[:60]
    lines[5] = "{not json"
    lines[9] = json.dumps({"id": "r", "messages": [{"role": "bot", "content": "x"}]})
    data.write_text("\n".join(lines) + "\n")
    for verbose in (False, True):
        run = tmp_path / f"run-{verbose}"
        cfg = _cfg(tiny_run_inputs, run, limit=20)
        run_pipeline(RunConfig(**{**cfg.__dict__, "data": str(data), "until": "prepare", "verbose": verbose}))
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("eyas")]
        log = (run / "logs" / "skipped.jsonl").read_text().splitlines()
        assert log == (run / "prepared" / "skipped.jsonl").read_text().splitlines()
        assert sorted(json.loads(x)["reason"] for x in log) == ["malformed JSON", "unknown role"]
        each = [x for x in err if x.startswith("eyas: skipped (")]
        assert len([x for x in err if x.startswith("eyas prepare: skipped 2 of")]) == 1
        if verbose:
            assert len(each) == 2 and any(f"{data} line 6" in x for x in each), err
        else:
            assert each == []


def test_overwrite_redoes_from_the_first_changed_stage(tiny_run_inputs, tmp_path):
    """A changed [train] value with --overwrite keeps the finished prepare and capture (same files, skipped after
    verification) and trains again with the new value; without --overwrite it is refused, saying what would be kept.
    A changed [[bench]] or bench dtype keeps the drafter; a changed [prepare] value starts again."""
    run = tmp_path / "run"
    run_pipeline(_cfg(tiny_run_inputs, run))
    assert (run / "report.md").exists()
    shard = next((run / "store").glob("*.safetensors"))
    prepared = run / "prepared" / "samples.jsonl"
    stamps = (shard.stat().st_mtime_ns, prepared.stat().st_mtime_ns)
    with pytest.raises(EyasError, match=r"lr.*--overwrite to redo train, bench, export and keep prepare, capture"):
        run_pipeline(_cfg(tiny_run_inputs, run, lr=2e-3))
    run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, run, lr=2e-3).__dict__, "overwrite": True, "until": "prepare"}))
    assert not (run / "train").exists() and not (run / "report.md").exists()  # nothing stale left to read
    log = run / "logs" / "run.log"
    before = log.read_text()
    state = run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, run, lr=2e-3).__dict__, "overwrite": True}))
    new = log.read_text()[len(before):]
    assert "prepare: done earlier" in new and "capture: done earlier" in new and "train: starting\n" in new
    assert (shard.stat().st_mtime_ns, prepared.stat().st_mtime_ns) == stamps      # kept, not rewritten
    assert json.loads((run / "train" / "manifest.json").read_text())["config"]["lr"] == 2e-3
    assert all(state["stages"][s]["done"] for s in ("prepare", "capture", "train", "bench", "export"))
    drafter = (run / "train" / "drafter" / "model.safetensors").stat().st_mtime_ns

    bench = [dict(prompts="heldout", method="chain", k=2, limit=2, max_turns=1, max_new_tokens=8)]
    before = log.read_text()
    run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, run, lr=2e-3, bench=bench).__dict__, "overwrite": True}))
    new = log.read_text()[len(before):]
    assert "train: done earlier" in new and "bench: starting" in new
    assert (run / "train" / "drafter" / "model.safetensors").stat().st_mtime_ns == drafter
    assert sorted(p.name for p in (run / "bench").glob("*.json")) == ["heldout-chain2.json"]  # the old one is gone

    # the dtype of the bench's target alone reaches the bench stage
    before = log.read_text()
    run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, run, lr=2e-3, bench=bench, bench_dtype="bf16").__dict__,
                              "overwrite": True}))
    new = log.read_text()[len(before):]
    assert "train: done earlier" in new and "bench: starting" in new
    assert json.loads((run / "bench" / "heldout-chain2.json").read_text())["dtype"] == "bf16"

    with pytest.raises(EyasError, match="max_new_tokens.*--overwrite to start it again|--overwrite to redo prepare"):
        run_pipeline(_cfg(tiny_run_inputs, run, lr=2e-3, bench=bench, bench_dtype="bf16", max_new_tokens=6))
    run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, run, lr=2e-3, bench=bench, bench_dtype="bf16",
                                   max_new_tokens=6).__dict__,
                              "overwrite": True}))
    new = log.read_text()
    assert "prepare: done earlier" not in new and "prepare: starting" in new   # the log itself started again


def test_first_changed_stage_maps_each_difference_to_the_first_stage_it_reaches():
    from eyas.run import _first_changed_stage

    base = {"target": "t", "data": "d", "preset": "p",
            "recipe": {"run": {"device": "cpu"}, "prepare": {"limit": 4}, "capture": {}, "train": {"lr": 1e-3},
                       "bench": [{"k": 3}]}}

    def first(table, value, top=None):
        new = json.loads(json.dumps(base))
        if top:
            new[top] = value
        else:
            new["recipe"][table] = value
        return _first_changed_stage(base, new)

    assert first("bench", [{"k": 5}]) == "bench"
    assert first("train", {"lr": 2e-3}) == "train"
    assert first("capture", {"dtype": "fp8"}) == "capture"
    assert first("prepare", {"limit": 5}) == "prepare"
    assert first("run", {"device": "cpu", "bench_dtype": "fp32"}) == "bench"
    assert first("run", {"device": "cpu", "online": True}) == "capture"
    assert first("run", {"device": "cpu", "online": True, "bench_dtype": "fp32"}) == "capture"  # the earliest
    assert first("run", {"device": "cuda"}) == "prepare"
    assert first("run", {"device": "cpu", "dtype": "bf16"}) == "prepare"
    assert first(None, "other-target", top="target") == "prepare"
    assert first("newtable", {"x": 1}) == "prepare"      # a table this version does not know


def test_a_run_sized_to_its_budget_keeps_its_plan_and_what_the_user_set(tiny_run_inputs, tmp_path):
    """budget_minutes: the machine is measured on the run's own stages, the plan saved in run.json; a budget the
    measuring alone exceeds gives the smallest plan; a resumed run keeps the plan without measuring again."""
    from eyas.sizing import MIN_CONVERSATIONS

    run = tmp_path / "run"
    cfg = _cfg(tiny_run_inputs, run, budget_minutes=0.01)
    cfg.overrides.pop("limit")   # the preset's 1,360 conversations, which sizing takes down
    state = run_pipeline(RunConfig(**{**cfg.__dict__, "until": "prepare"}))
    plan = state["plan"]
    assert plan["overrides"]["prepare.limit"] == MIN_CONVERSATIONS
    assert plan["overrides"]["prepare.regenerate_limit"] == 1
    assert all(v > 0 and math.isfinite(v) for v in plan["rates"].values())
    assert set(plan["estimate_s"]) == {"prepare", "capture", "train", "bench"}
    assert state["stages"]["prepare"]["summary"]["kept"] == MIN_CONVERSATIONS
    assert "bench.0.limit" not in plan["overrides"]     # the test's bench list sets its own limit
    log = run / "logs" / "run.log"
    assert "sizing the run to 0.01 minutes" in log.read_text()
    before = log.read_text()
    state = run_pipeline(RunConfig(**{**cfg.__dict__, "until": "capture"}))
    new = log.read_text()[len(before):]
    assert "as this run's first invocation chose it" in new and "sizing the run" not in new
    assert state["stages"]["capture"]["done"] and state["plan"] == plan
    # sizing turned off: the recipe as written is another configuration
    with pytest.raises(EyasError, match="limit"):
        run_pipeline(RunConfig(**{**cfg.__dict__, "overrides": {**cfg.overrides, "budget_minutes": 0}}))
    # a size given with --set is the user's: kept as given
    state = run_pipeline(RunConfig(**{**_cfg(tiny_run_inputs, tmp_path / "set", budget_minutes=0.01).__dict__,
                                      "until": "prepare"}))
    assert "prepare.limit" not in state["plan"]["overrides"] and state["stages"]["prepare"]["summary"]["kept"] == 40
