"""The bench's warm-up during `eyas run`'s training (eyas/bench/prewarm.py): the warm-up mode is the bench's own set-up
and warm-up, a warm-up process leaves the caches the bench proper then hits, and the run neither waits on nor leaves
behind a warm-up process that fails, hangs or outlives a killed run."""

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from support.models import make_tiny_llama
from eyas.bench import prewarm
from eyas.bench.bench import BenchConfig, run_bench
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.target import target_from_model
from test_run import tiny_run_inputs  # noqa: F401 - the tiny target and chats of test_run's pipeline

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def _target():
    from support.models import byte_tokenizer

    model = make_tiny_llama(vocab=258, seed=31)
    model.config.eos_token_id = model.generation_config.eos_token_id = 257
    return target_from_model(model, byte_tokenizer(), name="tiny", aux_layer_ids=(1, 2, 3))


def _drafter(model, seed):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(model.config, draft_vocab_size=200, aux_layer_ids=(1, 2, 3))
    return Eagle3Drafter(cfg).eval()


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [{"prompt": "hello there"}, {"prompt": "abcabcabcabc"}]) + "\n")
    return str(p)


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_warm_only_builds_exactly_the_bench_shape_set(prompts, method, tmp_path):
    """warm_only runs the bench's own set-up and warm-up and stops before decoding: it writes nothing, builds every
    runner shape a bench builds on a fresh runner, and a bench after it (another drafter of the same config: weights
    do not matter) builds nothing new, in its warm-up or inside the timed loop."""
    cfg = BenchConfig(prompts=prompts, method=method, k=3, top_k=3, depth=3, total_tokens=8, max_new_tokens=12,
                      max_seq=600, lossless_turns=0, json_out=str(tmp_path / "b.json"))
    fresh = _target()
    alone = run_bench(cfg, target=fresh, drafter=_drafter(fresh.model, 0))["warmup"]
    assert alone["built"] == alone["shapes"] > 0 and alone["late_shapes"] == 0
    (tmp_path / "b.json").unlink()

    target = _target()
    warm = run_bench(cfg, target=target, drafter=_drafter(target.model, 1), warm_only=True)
    assert "methods" not in warm and not (tmp_path / "b.json").exists()
    assert warm["warmup"]["built"] == warm["warmup"]["shapes"] == alone["shapes"]
    rep = run_bench(cfg, target=target, drafter=_drafter(target.model, 2))
    assert rep["warmup"] == {"shapes": alone["shapes"], "built": 0, "late_shapes": 0}
    assert (tmp_path / "b.json").exists()


# ---- across processes, compiled (the CPU's inductor) --------------------------------------------------------------

@pytest.mark.slow
def test_a_warm_up_process_leaves_every_graph_the_bench_builds_in_the_caches(tmp_path):
    """`python -m eyas.bench.prewarm` (a random drafter of the trained one's config) compiles the bench's graphs into
    $EYAS_CACHE/inductor; the bench proper, a later process with the real drafter, then finds every one of them
    there: FX-graph cache hits only, no miss. (No baselines and a chain of 1: the fewest compiles on the CPU.)"""
    from eyas.model.checkpoint import save_drafter
    from support.models import byte_tokenizer

    model = make_tiny_llama(hidden=32, heads=2, kv_heads=1, inter=64, vocab=258, seed=31)
    model.config.eos_token_id = model.generation_config.eos_token_id = 257
    model.save_pretrained(tmp_path / "target")
    byte_tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hello there"}) + "\n")
    drafter = _drafter(model, 5)
    save_drafter(drafter, tmp_path / "drafter")
    bench = dict(prompts=str(tmp_path / "p.jsonl"), method="chain", k=1, max_new_tokens=6, max_seq=128, limit=1,
                 baselines=False, lossless_turns=0, compile=True, device="cpu", dtype="fp32")
    spec = {"target": str(tmp_path / "target"), "device": "cpu", "dtype": "fp32", "parent": os.getpid(),
            "drafter": _drafter(model, 6).config.to_dict(), "benches": {"b": BenchConfig(**bench).to_dict()}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(EYAS_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    subprocess.run(prewarm.command(tmp_path / "spec.json", tmp_path / "warm.json"), env=env, check=True, cwd=ROOT,
                   capture_output=True)
    warm = json.loads((tmp_path / "warm.json").read_text())["benches"]["b"]
    assert warm["compile_cache"]["fx_graph_misses"] >= 2 and warm["compile_cache"]["fx_graph_hits"] == 0

    flags = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts",
             bench["prompts"], "--chain", "1", "--max-new-tokens", "6", "--max-seq", "128", "--limit", "1",
             "--no-baselines", "--lossless-turns", "0", "--compile", "--device", "cpu", "--dtype", "fp32",
             "--json", str(tmp_path / "b.json")]
    subprocess.run([sys.executable, "-m", "eyas", "bench", *flags], env=env, check=True, cwd=ROOT, capture_output=True)
    rep = json.loads((tmp_path / "b.json").read_text())
    assert rep["compile_cache"]["fx_graph_misses"] == 0
    assert rep["compile_cache"]["fx_graph_hits"] == warm["compile_cache"]["fx_graph_misses"]
    assert rep["warmup"]["shapes"] == warm["warmup"]["shapes"] and rep["warmup"]["late_shapes"] == 0



@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_benches_after_a_lossless_rerun_still_hit_the_warm_up_caches(tmp_path, device):
    """eyas run's bench stage: several benches in one process, each bf16 bench followed by its fp32 lossless rerun.
    The rerun's precision switch must leave every switch inductor's cache keys read as it found it, or each later
    bench misses the warm-up's graphs and compiles them again. Here the second bench
    (another chain length and cache size) must hit them too."""
    from eyas.model.checkpoint import save_drafter
    from support.models import byte_tokenizer

    model = make_tiny_llama(hidden=32, heads=2, kv_heads=1, inter=64, vocab=258, seed=31)
    model.config.eos_token_id = model.generation_config.eos_token_id = 257
    model.save_pretrained(tmp_path / "target")
    byte_tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hello there"}) + "\n")
    save_drafter(_drafter(model, 5), tmp_path / "drafter")
    common = dict(prompts=str(tmp_path / "p.jsonl"), method="chain", max_new_tokens=6, limit=1, baselines=False,
                  lossless_turns=1, compile=True, device=device, dtype="bf16")
    benches = {"a": BenchConfig(k=1, max_seq=128, **common).to_dict(),
               "b": BenchConfig(k=2, max_seq=192, **common).to_dict()}
    spec = {"target": str(tmp_path / "target"), "device": device, "dtype": "bf16", "parent": os.getpid(),
            "drafter": _drafter(model, 6).config.to_dict(), "benches": benches}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(EYAS_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    subprocess.run(prewarm.command(tmp_path / "spec.json", tmp_path / "warm.json"), env=env, check=True, cwd=ROOT,
                   capture_output=True)
    warm = json.loads((tmp_path / "warm.json").read_text())["benches"]
    assert all(w["compile_cache"]["fx_graph_misses"] >= 2 for w in warm.values())

    bench_stage = textwrap.dedent(f"""
        import json, sys, torch
        from eyas.bench.bench import BenchConfig, run_bench
        from eyas.model.checkpoint import open_drafter
        from eyas.target import load_target
        spec = json.load(open({str(tmp_path / "spec.json")!r}))
        target = load_target(spec["target"], device=spec["device"], dtype=torch.bfloat16)
        drafter = open_drafter({str(tmp_path / "drafter")!r})[0]
        out = {{n: run_bench(BenchConfig.from_dict({{**b, "json_out": None}}), target=target, drafter=drafter)
               for n, b in spec["benches"].items()}}
        json.dump({{n: [r["compile_cache"], r["lossless"]] for n, r in out.items()}}, open(sys.argv[1], "w"))
        """)
    subprocess.run([sys.executable, "-c", bench_stage, str(tmp_path / "bench.json")], env=env, check=True, cwd=ROOT,
                   capture_output=True)
    ran = json.loads((tmp_path / "bench.json").read_text())
    for name, (cache, lossless) in ran.items():
        assert lossless["eagle-chain"]["rerun"] and lossless["eagle-chain"]["held"], name
        assert cache["fx_graph_misses"] == 0, (name, cache)
        assert cache["fx_graph_hits"] == warm[name]["compile_cache"]["fx_graph_misses"], (name, cache)


def test_the_gpu_preset_keeps_its_compiled_steps_where_the_bench_compiles():
    """persist_steps is on in every gpu-preset bench on cuda, and dropped with the compile on a CPU rehearsal
    (`--set run.device=cpu`), which it would otherwise refuse."""
    from eyas.run import RunConfig, resolve_stages

    gpu = resolve_stages(RunConfig(preset="gpu"), Path("RUN"), vocab_size=49152).bench
    assert gpu and all(b.compile and b.persist_steps for b in gpu.values())
    cpu = resolve_stages(RunConfig(preset="gpu", overrides={"run.device": "cpu"}), Path("RUN"), vocab_size=49152).bench
    assert cpu.keys() == gpu.keys() and not any(b.compile or b.persist_steps for b in cpu.values())


# ---- eyas run -----------------------------------------------------------------------------------------------------

def _run_cfg(root, out, **over):
    from test_run import _cfg

    return _cfg(root, out, **{"run.prewarm_bench": True, **over})


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed run's orphan may wait for a reaper that never comes in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_run_warms_the_benches_in_another_process_while_training(tiny_run_inputs, tmp_path, monkeypatch):
    """The warm-up process is running when training starts (its pid in run.json) and warms every bench; with
    `--until train` the run waits for it before it returns (its caches serve the next invocation). The next
    invocation benches, and the drafter config the warm-up compiled for is the one training wrote."""
    import eyas.run as run_mod
    from eyas.run import RunConfig, run_pipeline

    real_train, seen = run_mod.STAGE_FUNCS["train"], []

    def train(cfg, c, run, target, redo=False):
        pid = json.loads((run / "run.json").read_text())["prewarm"]["pid"]
        seen.append((pid, _alive(pid)))
        return real_train(cfg, c, run, target, redo=redo)

    monkeypatch.setitem(run_mod.STAGE_FUNCS, "train", train)
    run = tmp_path / "run"
    state = run_pipeline(RunConfig(**{**_run_cfg(tiny_run_inputs, run).__dict__, "until": "train"}))
    pw = state["prewarm"]
    assert seen == [(pw["pid"], True)] and pw["returncode"] == 0 and not _alive(pw["pid"])
    assert set(pw["benches"]) == {"heldout-chain3"} and pw["benches"]["heldout-chain3"]["warmup"]["shapes"] > 0
    assert "bench" not in state["stages"]
    state = run_pipeline(_run_cfg(tiny_run_inputs, run))
    assert state["stages"]["bench"]["done"] and len(seen) == 1   # train done earlier: no second warm-up
    assert state["prewarm"]["drafter_matched"] is True and set(state["prewarm"]["bench"]) == {"heldout-chain3"}
    # the knob is not part of the run's identity: turning it off resumes the same run
    assert _run_cfg(tiny_run_inputs, run).identity() == \
        _run_cfg(tiny_run_inputs, run, **{"run.prewarm_bench": False}).identity()


def test_auto_mode_warms_only_a_target_that_fits_twice(monkeypatch):
    """prewarm_bench left unset warms beside training only while the warm-up's copy of the target's weights takes
    at most AUTO_SHARE of the GPU's memory (the 135M target in bf16: about 0.2% of an H200's)."""
    from types import SimpleNamespace

    model = torch.nn.Linear(1000, 1000, bias=False).to(torch.bfloat16)   # 2,000,000 bytes of weights
    target = SimpleNamespace(device=torch.device("cuda", 0), model=model)
    for total, fits in ((2_000_000 / prewarm.AUTO_SHARE, True), (2_000_000 / prewarm.AUTO_SHARE - 1, False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev, t=total: SimpleNamespace(total_memory=t))
        assert prewarm.fits_beside_training(target) is fits
    assert prewarm.fits_beside_training(SimpleNamespace(device=torch.device("cpu"), model=model))


@pytest.mark.parametrize("how", ["fails", "hangs"])
def test_the_bench_runs_when_the_warm_up_fails_or_hangs(tiny_run_inputs, tmp_path, monkeypatch, how):
    """A warm-up process that exits with an error, or is still running after the bounded wait (then stopped), costs
    the run one log line: the bench stage runs and finishes, and no warm-up process is left."""
    from eyas.run import run_pipeline

    code = "import sys; sys.exit(3)" if how == "fails" else "import time; time.sleep(600)"
    monkeypatch.setattr(prewarm, "command", lambda spec, result: [sys.executable, "-c", code, str(spec)])
    monkeypatch.setattr(prewarm, "WAIT_S", 0.5)
    run = tmp_path / "run"
    state = run_pipeline(_run_cfg(tiny_run_inputs, run))
    pw = state["prewarm"]
    assert state["stages"]["bench"]["done"] and json.loads((run / "bench" / "heldout-chain3.json").read_text())
    assert "benches" not in pw and not _alive(pw["pid"])
    log = (run / "logs" / "run.log").read_text()
    if how == "fails":
        assert pw["returncode"] == 3 and "prewarm: failed (exit status 3" in log
    else:
        assert pw["returncode"] == -signal.SIGTERM and pw["finished_before_bench"] is False
        assert "prewarm: not finished after waiting" in log


def test_an_interrupted_run_stops_its_warm_up(tiny_run_inputs, tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) during training: the run records the train stage as unfinished, as before, and
    its warm-up process is gone by the time run_pipeline has raised."""
    import eyas.run as run_mod

    monkeypatch.setattr(prewarm, "command", lambda spec, result: [sys.executable, "-c", "import time; "
                                                                  "time.sleep(600)", str(spec)])
    pids = []

    def train(cfg, c, run, target, redo=False):
        pids.append(json.loads((run / "run.json").read_text())["prewarm"]["pid"])
        assert _alive(pids[0])
        raise KeyboardInterrupt

    monkeypatch.setitem(run_mod.STAGE_FUNCS, "train", train)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_mod.run_pipeline(_run_cfg(tiny_run_inputs, run))
    assert pids and not _alive(pids[0])
    assert json.loads((run / "run.json").read_text())["stages"]["train"]["done"] is False


_KILLED_RUN = """
import sys, time
import eyas.run as run_mod
from eyas.bench import prewarm
sys.path.insert(0, {tests!r})
from test_run import _cfg
from pathlib import Path
prewarm.command = lambda spec, result: [sys.executable, "-c", "import time; time.sleep(600)", str(spec)]
real = run_mod.STAGE_FUNCS["train"]
def train(*a, **kw):
    print("training", flush=True)
    time.sleep(600)
run_mod.STAGE_FUNCS["train"] = train
run_mod.run_pipeline(_cfg(Path({root!r}), Path({out!r}), **{{"run.prewarm_bench": True}}))
"""


def test_a_run_killed_during_training_resumes_and_leaves_no_warm_up_process(tiny_run_inputs, tmp_path):
    """kill -9 of `eyas run` while it trains leaves its warm-up process (here one that ignores its parent's death)
    running; the resumed run stops it by the pid in run.json, trains, benches and finishes."""
    from eyas.run import run_pipeline

    run = tmp_path / "run"
    script = _KILLED_RUN.format(tests=str(ROOT / "tests"), root=str(tiny_run_inputs), out=str(run))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        for line in parent.stdout:  # the run's own log lines, then the fake train stage's
            if line.strip() == "training":
                break
        pid = json.loads((run / "run.json").read_text())["prewarm"]["pid"]
        assert _alive(pid)
        parent.kill()
        parent.wait()
        time.sleep(0.5)
        assert _alive(pid)  # an orphan now: only the resumed run can stop it
        state = run_pipeline(_run_cfg(tiny_run_inputs, run))
        assert not _alive(pid)
        assert f"prewarm: stopped the warm-up process (pid {pid})" in (run / "logs" / "run.log").read_text()
        assert all(state["stages"][s]["done"] for s in ("prepare", "train", "bench", "export"))
        assert state["prewarm"]["pid"] != pid and state["prewarm"]["returncode"] == 0
        assert not _alive(state["prewarm"]["pid"])
    finally:
        parent.kill()
        if _alive(pid := json.loads((run / "run.json").read_text()).get("prewarm", {}).get("pid", 0) or 0):
            os.killpg(pid, signal.SIGKILL)


def test_the_warm_up_process_exits_when_its_parent_dies(tmp_path):
    """watch_parent: the real child's guard against a parent killed with no chance to stop it."""
    code = textwrap.dedent("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import os, time; from eyas.bench.prewarm import watch_parent; watch_parent(os.getppid(), 0.1); "
            "time.sleep(600)"], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.0)
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.time() + 10
        while _alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
