"""`eyas run`: prepare -> capture (or online) -> train -> bench -> export -> report, resumable by stage.

RUN/
  run.json        resolved config + per-stage status (the resume record)
  prepared/       eyas prepare output           store/    eyas capture output (offline recipes)
  train/          eyas train run (drafter/, vocab, checkpoints/, metrics.jsonl, tb/)
  bench/          one JSON + PNG per benchmark   export/   SGLang/vLLM checkpoint
  report.md, plots/*.png, logs/run.log
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import eyas.target  # load_target looked up at call time: tests patch it
import eyas.target.device  # its functions looked up at call time: tests patch them
from eyas.bench import prewarm as bench_prewarm
from eyas.bench.bench import BenchConfig, graph_round_default, run_bench
from eyas.capture.capture import CaptureConfig, run_capture
from eyas.data.longprompts import is_long_set
from eyas.data.prepare import PrepareConfig, run_prepare, skipped_lines
from eyas.data.prepared import PreparedData
from eyas.data.sources import resolve_data
from eyas.errors import EyasError
from eyas.export.export import export_drafter
from eyas.knobs import add_command, add_flags, from_args, from_knobs
from eyas.manifest import atomic_write_bytes, diff_dicts
from eyas.model.checkpoint import open_drafter
from eyas.recipes import (Recipe, load_recipe, preset as preset_recipe, resolve_dtype, resolve_key, shown_identity,
                          with_overrides)
from eyas.report import plan_changes, write_report
from eyas.sizing import choose, measure
from eyas.store.reader import Store
from eyas.target.load import resolve
from eyas.train import prewarm as train_prewarm
from eyas.train.config import EAGLE_ONLY, TrainConfig
from eyas.train.trainer import run_train
from eyas.warmup import await_warmup, stop_stale

STAGES = ("prepare", "capture", "train", "bench", "export")


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    target: str = "smollm2-135m"
    """Target model (embedded name, HF dir, hub id, GGUF)."""
    data: str = "sharegpt"
    """Conversations: `sharegpt`, a .json / .jsonl file (OpenAI messages or ShareGPT conversations), a .parquet file
    or a directory a Hugging Face dataset was saved to (docs/data.md)."""
    preset: str = "cpu-demo"
    """A shipped recipe (cpu-demo or gpu); with `recipe_file`, the name the run and its report go by."""
    recipe_file: str | None = None
    """A recipe TOML file (eyas.recipes) instead of the preset."""
    out: str = "runs/eyas-run"
    """Run directory."""
    overrides: dict = field(default_factory=dict)
    """Recipe values changed on the command line (e.g. {"train.epochs": 3}; the short names of eyas.recipes.ALIASES
    work too)."""
    overwrite: bool = False
    """Rerun a run directory of another configuration instead of refusing: the finished stages before the first
    one whose configuration changed are kept (after verification), that stage and the later ones are redone."""
    quiet: bool = False
    """No progress bars; only the final summary."""
    verbose: bool = False
    """Print every skipped record and dropped sample (always written to RUN/logs/skipped.jsonl)."""
    until: str | None = None
    """Stop after this stage (e.g. to fit a job into time slices); a rerun without it continues."""
    trust_remote_code: bool = False
    """Let the target's own code (a remote-code tokenizer or config, as Kimi-K2.5's) run, in every stage that opens
    the target; not part of the run's identity (it changes no output)."""

    def __post_init__(self):
        if self.until is not None and self.until not in STAGES:
            raise EyasError(f"--until {self.until!r}: expected one of {', '.join(STAGES)}")
        # the recipe, every --set value and every stage config built from them are checked up front
        resolve_stages(self, Path(self.out), vocab_size=None)

    @property
    def recipe(self) -> Recipe:
        """The resolved recipe: the preset or the recipe file, with the --set overrides applied."""
        base = load_recipe(self.recipe_file, name=self.preset) if self.recipe_file else preset_recipe(self.preset)
        return with_overrides(base, self.overrides)

    def identity(self) -> dict:
        """What must match for a rerun to resume this run directory."""
        return {"target": self.target, "data": self.data, "preset": self.preset, "recipe": self.recipe.identity()}


@dataclass(frozen=True)
class Stages:
    """The stage configs of one run, resolved from its recipe (paths, derived values)."""

    prepare: PrepareConfig
    capture: CaptureConfig | None
    train: TrainConfig
    bench: dict[str, BenchConfig]
    """By name: the file stem of the benchmark's JSON under RUN/bench."""


def resolve_stages(cfg: RunConfig, run: Path, *, vocab_size: int | None, progress: bool = True) -> Stages:
    """Every stage's config from the recipe; what eyas run sets or derives is set here, and only here."""
    r = cfg.recipe
    dev = r.run.device

    def build(table, cls, **kw):
        try:
            return from_knobs(cls, kw)
        except ValueError as e:  # a value the stage refuses: name the recipe and the table
            msg = str(e).removeprefix(f"{table}: ")
            raise EyasError(f"recipe {r.name} [{table}]: {msg}") from None

    trust = dict(trust_remote_code=cfg.trust_remote_code)   # every stage that opens the target
    prepare = build("prepare", PrepareConfig, target=cfg.target, data=cfg.data, out=str(run / "prepared"), **trust,
                    **r.prepare)
    capture = build("capture", CaptureConfig, out=str(run / "store"), target=cfg.target, data=str(run / "prepared"),
                    device=dev, progress=progress, **trust, **r.capture) if r.run.capture else None
    train = dict(r.train)
    given = [resolve_key(k) for k in cfg.overrides]
    dflash = train.get("method") == "dflash"
    if dflash:  # a preset's EAGLE-3 knobs do not apply to a block drafter (a --set one is refused by TrainConfig)
        for k in EAGLE_ONLY:
            if ("train", k) not in given:
                train.pop(k, None)
    if train.get("draft_vocab") is not None and vocab_size is not None:
        # a recipe's value is capped at the target's vocabulary (a preset serves every target); a --set one is refused
        asked = [k for k in cfg.overrides if resolve_key(k) == ("train", "draft_vocab")]
        if asked and train["draft_vocab"] > vocab_size:
            raise EyasError(f"--set {asked[-1]}={train['draft_vocab']}: larger than the target's vocabulary "
                            f"({vocab_size} tokens of {cfg.target}); use at most {vocab_size}")
        train["draft_vocab"] = min(train["draft_vocab"], vocab_size)  # no larger than the target's vocabulary
    if dev != "cuda" and train.get("attention") == "flex":  # flex has no backward off CUDA (a CPU rehearsal)
        asked = [k for k in cfg.overrides if resolve_key(k) == ("train", "attention")]
        if asked:
            raise EyasError(f"--set {asked[-1]}=flex: flex attention trains on CUDA only; use auto, dense or blocks "
                            f"on the {dev}")
        train["attention"] = "auto"
    src = dict(data=str(run / "prepared")) if r.run.online else dict(store=str(run / "store"))
    train = build("train", TrainConfig, out=str(run / "train"), target=cfg.target, device=dev,
                  max_len=prepare.max_len, progress=progress, **trust, **src, **train)
    bench = {}
    for i, b in enumerate(r.bench):
        if dflash and b.get("method", "chain") == "tree":  # a block drafter drafts no trees
            continue
        # "heldout" = the held-out split of the run's own data, which prepare never wrote
        prompts = b.get("prompts", "sharegpt-heldout")
        if prompts == "heldout":
            prompts = "sharegpt-heldout" if cfg.data == "sharegpt" else f"heldout:{cfg.data}"
        label = "sharegpt-heldout" if prompts == "sharegpt-heldout" else (
            "heldout" if prompts.startswith("heldout:") else "long" if is_long_set(prompts) else Path(prompts).stem)
        table = {**b, "prompts": prompts}
        if dflash and table.get("method", "chain") == "chain" and ("bench", i, "k") not in given:
            table.pop("k", None)  # the whole block a round (k = B-1) unless --set
        if not is_long_set(prompts):  # unless the table sets it: prompts that leave room for a reply inside the
            # training budget (RoPE positions seen); the long set keeps its own range (BenchConfig)
            table.setdefault("max_prompt_tokens", max(1, prepare.max_len - prepare.regen.max_new_tokens))
        if dev != "cuda":  # the bench compiles on cuda only, and saved steps are compiled ones (a CPU rehearsal)
            table.pop("persist_steps", None)
        if "graph_round" not in table and table.get("method", "chain") in ("chain", "tree"):  # as `eyas bench` does
            table["graph_round"] = graph_round_default(dev, float(table.get("temperature", 0.0)))
        bc = build("bench", BenchConfig, **table, target=cfg.target, device=dev, compile=dev == "cuda",
                   json_out=None, **trust)
        if dflash and bc.spec.method == "chain":
            name = f"{label}-dflash" + (f"{bc.spec.k}" if "k" in table else "")
        else:
            name = f"{label}-{bc.spec.method}" + (f"{bc.spec.k}" if bc.spec.method == "chain" else "")
        if name in bench and dflash and name.endswith("-dflash"):  # chains that differed in k: one block bench
            continue
        if name in bench:
            raise EyasError(f"recipe {r.name}: two [[bench]] tables write bench/{name}.json")
        bench[name] = replace(bc, json_out=str(run / "bench" / f"{name}.json"))
    return Stages(prepare=prepare, capture=capture, train=train, bench=bench)


class Log:
    """Print (unless quiet) and append to RUN/logs/run.log."""

    def __init__(self, run: Path, quiet: bool):
        (run / "logs").mkdir(parents=True, exist_ok=True)
        self.path, self.quiet = run / "logs" / "run.log", quiet

    def __call__(self, msg: str, *, always: bool = False) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if always or not self.quiet:
            print(line, flush=True)


def _open_state(cfg: RunConfig, run: Path, *, check_only: bool = False) -> dict | None:
    """The run directory's state: a new one, the same run resumed, or (--overwrite) a changed run that keeps the
    finished stages before the first one whose configuration changed. check_only: refuse as it would, change nothing
    on disk and return None (run_pipeline calls it so before it opens the target)."""
    if run.exists() and not run.is_dir():
        raise EyasError(f"{run}: exists and is not a directory")
    path = run / "run.json"
    if path.exists():
        state, new = json.loads(path.read_text()), cfg.identity()
        old = state["identity"]
        if "recipe" not in old and not cfg.overwrite:
            raise EyasError(f"{path}: written by an older eyas (its identity holds no recipe); use another --out, or "
                            f"--overwrite to start it again")
        diffs = diff_dicts(old, new)
        if not diffs:
            return state
        first = _first_changed_stage(old, new)
        redo = STAGES[STAGES.index(first):]
        kept = [s for s in STAGES[:STAGES.index(first)] if state["stages"].get(s, {}).get("done")]
        if not cfg.overwrite:
            hint = (f"--overwrite to redo {', '.join(redo)} and keep {', '.join(kept)}" if kept
                    else "--overwrite to start it again")
            shown = diff_dicts(shown_identity(old), shown_identity(new)) or diffs
            raise EyasError(f"{run}: holds a run of another configuration ({'; '.join(shown)}); "
                            f"use another --out, or {hint}")
        if check_only:
            return None
        if first != "prepare":
            for stage in redo:
                shutil.rmtree(run / _stage_dir(stage), ignore_errors=True)
                state["stages"].pop(stage, None)
            shutil.rmtree(run / "plots", ignore_errors=True)  # the report is rebuilt at the end
            (run / "report.md").unlink(missing_ok=True)
            state["identity"] = new
            return state
        shutil.rmtree(run)
    if check_only:
        return None
    run.mkdir(parents=True, exist_ok=True)
    return {"identity": cfg.identity(), "stages": {}, "created": time.strftime("%Y-%m-%d %H:%M:%S")}


_RUN_KEY_STAGE = {"bench_dtype": "bench", "capture": "capture", "online": "capture"}
"""The first stage a [run] value reaches; the others (device, dtype) reach prepare."""


def _first_changed_stage(old: dict, new: dict) -> str:
    """The first stage whose inputs differ between two identities: a recipe table maps to its stage (the bench
    tables to bench), a [run] value to the first stage that reads it; the target, the data and the preset name to
    prepare, that is, to everything."""
    if any(old.get(k) != new.get(k) for k in set(old) | set(new) if k != "recipe"):
        return "prepare"
    ro, rn = old.get("recipe", {}), new.get("recipe", {})
    changed = set()
    for table in set(ro) | set(rn):
        a, b = ro.get(table), rn.get(table)
        if a == b:
            continue
        if table == "run" and isinstance(a, dict) and isinstance(b, dict):
            changed |= {_RUN_KEY_STAGE.get(k, "prepare") for k in set(a) | set(b) if a.get(k) != b.get(k)}
        else:  # a stage's table reaches that stage; a table this version does not know, everything
            changed.add(table if table in STAGES else "prepare")
    return min(changed, key=STAGES.index) if changed else "prepare"


def _save_state(run: Path, state: dict) -> None:
    atomic_write_bytes(run / "run.json", (json.dumps(state, indent=2) + "\n").encode())


def _verify(stage: str, run: Path, target) -> None:
    """Raise if a finished stage's output no longer checks out (then the stage is redone)."""
    if stage == "prepare":
        PreparedData(run / "prepared", target=target)
    elif stage == "capture":
        Store(run / "store", target=target).verify()
    elif stage == "train":
        open_drafter(run / "train")
    elif stage == "bench":
        for p in (run / "bench").glob("*.json"):
            json.loads(p.read_text())
    elif stage == "export":
        open_drafter(run / "export", target)


def run_pipeline(cfg: RunConfig) -> dict:
    """Run (or resume) every stage; returns the run state with each stage's summary."""
    import torch

    r = cfg.recipe.run
    if r.device == "cuda" and not torch.cuda.is_available():
        asked = [k for k in cfg.overrides if resolve_key(k) == ("run", "device")]
        why = f"--set {asked[-1]}=cuda" if asked else f"recipe {cfg.preset!r} runs on cuda"
        raise EyasError(f"{why}, but this machine has no CUDA GPU; use --preset cpu-demo (or --set run.device=cpu)")
    run = Path(cfg.out)
    t_start = time.time()
    user_keys = {resolve_key(k) for k in cfg.overrides}
    # a resumed run keeps the plan its first invocation chose, unless sizing is now off (budget_minutes=0): then
    # the recipe as written is another configuration, refused or (--overwrite) redone as any other
    saved = _saved_plan(run) if cfg.recipe.run.budget_minutes else None
    if saved is not None:
        cfg = replace(cfg, overrides={**saved["overrides"], **cfg.overrides})
    # The run directory is refused, then the target opened, before anything is written: a run that cannot start
    # leaves no directory behind.
    _open_state(cfg, run, check_only=True)
    resolve_data(cfg.data)  # a source in no accepted format, or a table without conversations: refused here
    dtype = resolve_dtype(r.dtype, r.device)
    target = eyas.target.load_target(cfg.target, device=r.device, dtype=_dtype(dtype), trust_remote_code=cfg.trust_remote_code)
    state = _open_state(cfg, run)
    log = Log(run, cfg.quiet)
    _save_state(run, state)
    for key, name in (("prewarm", "prewarm"), ("train_prewarm", "train-prewarm")):  # a killed run's, maybe alive
        if (old := state.get(key) or {}).get("pid") and "returncode" not in old:
            if stop_stale(old["pid"], run.resolve() / "logs", name):
                log(f"{name}: stopped the warm-up process (pid {old['pid']}) an interrupted run left running")
    log(f"eyas run: preset {cfg.preset}, target {cfg.target}, data {cfg.data} -> {run}", always=True)
    if cfg.preset == "cpu-demo":
        log("this is a demonstration on the CPU (small data, short training); for a real drafter run "
            "`eyas run --preset gpu` on a CUDA machine", always=True)
    if r.device == "cpu" and r.dtype == "auto":
        log("cpu: native bf16, so bf16 weights and autocast" if eyas.target.device.cpu_bf16_fast() else
            "cpu: no native bf16 instructions (AVX512-BF16/AMX), so fp32", always=True)
    configs = resolve_stages(cfg, run, vocab_size=target.vocab_size, progress=not cfg.quiet)
    if r.budget_minutes and saved is None and not state["stages"]:
        cfg, configs = _size(cfg, configs, run, target, state, log, user_keys, dtype, t_start)
    elif saved is not None:  # an --overwrite from prepare starts a new state: the plan stays the run's
        state["plan"] = saved
        _save_state(run, state)
        log(f"plan: as this run's first invocation chose it ({_plan_words(saved)})", always=True)
    stages = [s for s in STAGES if s != "capture" or configs.capture is not None]
    started = {}  # the warm-up processes ("train": as prepare starts, "bench": as train starts)
    try:
        _run_stages(cfg, configs, run, target, state, log, stages, started)
        # --until stopped before the bench: the caches the warm-up fills on disk serve the next invocation's bench
        if "bench" in started and "returncode" not in state["prewarm"]:
            state["prewarm"].update(bench_prewarm.await_before_bench(started["bench"], log))
    finally:
        for proc in started.values():  # interrupted, failed, or done: never leave it running
            proc.stop()
    state["wall_seconds_this_invocation"] = round(time.time() - t_start, 1)
    _save_state(run, state)
    if cfg.until is not None and not all(state["stages"].get(s, {}).get("done") for s in stages):
        log(f"stopped after {cfg.until} (--until); rerun without --until to continue", always=True)
        return state
    summary = write_report(run, state, cfg)
    log("report: " + str(run / "report.md"), always=True)
    print(summary, flush=True)
    return state


def _saved_plan(run: Path) -> dict | None:
    """The plan the sizing of an earlier invocation of this run chose (run.json's `plan`), if any."""
    try:
        plan = json.loads((run / "run.json").read_text())["plan"]
        return plan if isinstance(plan.get("overrides"), dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _size(cfg, configs, run, target, state, log, user_keys: set, dtype: str, t_start: float):
    """Measure this machine, choose the plan that fits [run] budget_minutes (eyas.sizing), save it in run.json; the
    run's config and stages with the plan applied."""
    r = cfg.recipe.run
    log(f"sizing the run to {r.budget_minutes:g} minutes: measuring this machine on each stage's work", always=True)
    rates = measure(target, configs, bench_dtype=r.bench_dtype or dtype)
    plan = choose(configs, rates, r.budget_minutes * 60, spent_s=time.time() - t_start, fixed=user_keys,
                  bench_tables=len(cfg.recipe.bench))
    if plan.overrides:
        cfg = replace(cfg, overrides={**plan.overrides, **cfg.overrides})
        configs = resolve_stages(cfg, run, vocab_size=target.vocab_size, progress=not cfg.quiet)
        state["identity"] = cfg.identity()
    state["plan"] = {**plan.to_dict(), "rates": rates.to_dict()}
    _save_state(run, state)
    log(f"plan: {_plan_words(state['plan'])}", always=True)
    return cfg, configs


def _plan_words(plan: dict) -> str:
    est = plan["estimate_s"]
    stages = ", ".join(f"{k} {v / 60:.1f}" for k, v in est.items())
    sized = plan_changes(plan) + (" (--set a key to choose it yourself, budget_minutes=0 for the recipe as written)"
                                  if plan["overrides"] else "")
    return (f"{sized}; estimated {sum(est.values()) / 60:.0f} minutes of stages ({stages}) within "
            f"{plan['budget_s'] / 60:g}, after {plan['rates']['seconds']:.0f} s of measuring")


def _run_stages(cfg, configs, run, target, state, log, stages, started: dict) -> None:
    """Each stage in order, skipping verified finished ones; the warm-up processes it starts go in `started`."""
    if (proc := _start_train_prewarm(cfg, configs, run, target, state, log, stages)) is not None:
        started["train"] = proc
    for stage in stages:
        if cfg.until is not None and STAGES.index(stage) > STAGES.index(cfg.until):
            break
        st = state["stages"].get(stage, {})
        if st.get("done"):
            try:
                _verify(stage, run, target)
                log(f"{stage}: done earlier ({st.get('seconds', 0):.0f} s), verified, skipped")
                continue
            except (EyasError, OSError, ValueError, json.JSONDecodeError) as e:
                log(f"{stage}: its output failed verification on resume ({e}); redoing the stage", always=True)
                st = {"redo": True}
        if stage == "train" and "train" in started:
            _await_train_prewarm(started["train"], state, run, log)
        if stage == "train" and (proc := _start_prewarm(cfg, configs, run, target, state, log)) is not None:
            started["bench"] = proc
        elif stage == "bench" and "bench" in started:
            state["prewarm"].update(bench_prewarm.await_before_bench(started["bench"], log))
        log(f"{stage}: starting" + (" (resuming)" if (run / _stage_dir(stage)).exists() else ""))
        t0, before = time.time(), st.get("seconds", 0.0) if not st.get("done") else 0.0
        extra = {"prewarm": state.get("prewarm")} if stage == "bench" else {}
        try:
            summary = STAGE_FUNCS[stage](cfg, configs, run, target, redo=bool(st.get("redo")), **extra)
        except KeyboardInterrupt:  # e.g. `timeout -s INT`: keep the time spent so far, resume on the next run
            state["stages"][stage] = {"done": False, "redo": bool(st.get("redo")),
                                      "seconds": round(before + time.time() - t0, 1)}
            _save_state(run, state)
            log(f"{stage}: interrupted after {time.time() - t0:.0f} s; rerun the same command to resume", always=True)
            raise
        # seconds: this stage's wall time over every invocation that worked on it
        state["stages"][stage] = {"done": True, "seconds": round(before + time.time() - t0, 1),
                                  "summary": summary}
        _save_state(run, state)
        log(f"{stage}: finished in {time.time() - t0:.0f} s")


# ---- training's warm-up during prepare (eyas/train/prewarm.py) -------------------------------------------------

def _start_train_prewarm(cfg, c: Stages, run, target, state, log, stages):
    """Start training's compile warm-up when [run] prewarm_train (or, unset, a compiled online train stage on CUDA
    whose target's second copy fits beside prepare, eyas.bench.prewarm.AUTO_SHARE) asks for it and a stage before
    train is still to run (else there is nothing to overlap it with); None otherwise. Any failure to start is one
    log line: training then compiles its graphs itself."""
    r, t = cfg.recipe.run, c.train
    before = [s for s in stages[:stages.index("train")] if not state["stages"].get(s, {}).get("done")]
    wanted = (r.prewarm_train if r.prewarm_train is not None
              else t.compile and r.device == "cuda" and bench_prewarm.fits_beside_training(target))
    if not (wanted and t.online and before) or state["stages"].get("train", {}).get("done") or (
            cfg.until is not None and STAGES.index(cfg.until) < STAGES.index("train")):
        return None
    try:
        proc = train_prewarm.start(run.resolve() / "logs", t, target_spec=cfg.target, device=r.device,
                             dtype=resolve_dtype(r.dtype, r.device), trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation; the run goes on without it
        log(f"train-prewarm: not started ({type(e).__name__}: {e}); training compiles its graphs itself", always=True)
        return None
    state["train_prewarm"] = {"pid": proc.pid}
    _save_state(run, state)   # the pid first: a resumed run stops a warm-up that a killed run left
    log(f"train-prewarm: compiling training's graphs in the background (pid {proc.pid}, logs/train-prewarm.log)")
    return proc


def _await_train_prewarm(proc, state, run, log) -> None:
    """Before the train stage: wait for training's warm-up (at most its WAIT_S, then stop it) and record how it
    went in run.json's train_prewarm."""
    state["train_prewarm"].update(await_warmup(proc, log, train_prewarm.WAIT_S, stage="train", beside="prepare",
                                               marker="startup", who="training"))
    # its synthetic data and drafter: scratch
    shutil.rmtree(run.resolve() / "logs" / train_prewarm.NAME, ignore_errors=True)
    _save_state(run, state)


# ---- the bench's warm-up during training (eyas/bench/prewarm.py) ------------------------------------------------

def _start_prewarm(cfg, c: Stages, run, target, state, log):
    """Start the warm-up process for the benches whose JSONs are not written yet, when [run] prewarm_bench (or,
    unset, a bench that compiles) asks for it; None otherwise. Any failure to start is one log line: the bench then
    compiles its graphs itself."""
    r = cfg.recipe.run
    pending = {n: b for n, b in c.bench.items() if not Path(b.json_out).exists()}
    wanted = r.prewarm_bench if r.prewarm_bench is not None else any(b.compile for b in pending.values())
    if not (wanted and pending) or state["stages"].get("bench", {}).get("done"):
        return None
    if r.prewarm_bench is None and not bench_prewarm.fits_beside_training(target):
        log(f"prewarm: off, a second copy of the target's weights would take over "
            f"{bench_prewarm.AUTO_SHARE:.0%} of the "
            f"GPU's memory beside training (--set run.prewarm_bench=true to warm anyway)", always=True)
        return None
    try:
        proc = bench_prewarm.start(run.resolve() / "logs", pending, c.train, target, target_spec=cfg.target,
                             dtype=r.bench_dtype or resolve_dtype(r.dtype, r.device),
                             trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation; the run goes on without it
        log(f"prewarm: not started ({type(e).__name__}: {e}); the bench compiles its graphs itself", always=True)
        return None
    state["prewarm"] = {"pid": proc.pid, "pending": list(pending), "drafter_config": proc.drafter_config}
    _save_state(run, state)   # the pid first: a resumed run stops a warm-up that a killed run left
    log(f"prewarm: warming {len(pending)} bench(es) in the background (pid {proc.pid}, logs/prewarm.log)")
    return proc


def _stage_dir(stage: str) -> str:
    return {"prepare": "prepared", "capture": "store"}.get(stage, stage)


def _prepare(cfg, c: Stages, run, target, redo=False) -> dict:

    counts = run_prepare(replace(c.prepare, overwrite=redo), target, progress=not cfg.quiet)["counts"]
    src = Path(c.prepare.out) / "skipped.jsonl"
    if src.exists():
        shutil.copyfile(src, run / "logs" / "skipped.jsonl")
        if cfg.verbose:
            for line in skipped_lines(src):
                print(line, file=sys.stderr)
    return counts


def _capture(cfg, c: Stages, run, target, redo=False) -> dict:
    run_capture(replace(c.capture, overwrite=redo), target)
    return Store(run / "store", target=target).info()


def _train(cfg, c: Stages, run, target, redo=False) -> dict:
    out = Path(c.train.out)
    resume = out.exists() and not redo
    if redo:
        shutil.rmtree(out, ignore_errors=True)
    return run_train(replace(c.train, resume=resume), target)


def _bench(cfg, c: Stages, run, target, redo=False, prewarm: dict | None = None) -> dict:
    r = cfg.recipe.run
    dtype = resolve_dtype(r.dtype, r.device)
    if (r.bench_dtype or dtype) != dtype:  # e.g. an exact fp32 lossless check after bf16 data and training
        target = eyas.target.load_target(cfg.target, device=r.device, dtype=_dtype(r.bench_dtype),
                             trust_remote_code=cfg.trust_remote_code)
    drafter, meta = open_drafter(run, target)
    drafter = drafter.to(target.device)
    if prewarm and "drafter_config" in prewarm:  # the warm-up compiled for the config training was to write
        prewarm["drafter_matched"] = json.loads(json.dumps(drafter.config.to_dict())) == prewarm["drafter_config"]
        if not prewarm["drafter_matched"]:
            Log(run, cfg.quiet)("prewarm: the trained drafter's config differs from the one warmed; the bench "
                                "compiles the drafter's graphs itself", always=True)
    results, ran = {}, {}
    (run / "bench").mkdir(exist_ok=True)
    sink = open(run / "logs" / "bench.log", "a")
    try:
        for name, bc in c.bench.items():
            path = Path(bc.json_out)
            if path.exists() and not redo:
                results[name] = json.loads(path.read_text())
                continue
            results[name] = ran[name] = run_bench(bc, target=target, drafter=drafter, drafter_meta=meta,
                                                  out=sink if cfg.quiet else sys.stdout)
    finally:
        sink.close()
    if prewarm is not None:  # what the benches still compiled: 0 misses when the warm-up covered them
        prewarm["bench"] = {n: {"warmup_s": r["seconds"]["warmup"], "warmup": r["warmup"],
                                **({"compile_cache": r["compile_cache"]} if "compile_cache" in r else {})}
                            for n, r in ran.items()}
    return {n: {m: {key: r["methods"][m].get(key) for key in ("tau", "tokens_per_s", "speedup")}
                for m in r["methods"]} | {"lossless": r.get("lossless")} for n, r in results.items()}


def _export(cfg, c: Stages, run, target, redo=False) -> dict:
    drafter, meta = open_drafter(run)  # the target is checked once, by export_drafter
    served = str(resolve(cfg.target)[0])  # the engines need an HF directory (the GGUF's safetensors cache)
    chain = max((b.spec.k for b in c.bench.values() if b.spec.method == "chain"), default=3)
    path = export_drafter(drafter, run / "export", meta=meta, target=target, target_ref=served,
                          num_speculative_tokens=chain)
    return {"path": str(path), "served_target": served}


STAGE_FUNCS = {"prepare": _prepare, "capture": _capture, "train": _train, "bench": _bench, "export": _export}


def parse_knob(text: str) -> tuple[str, object]:
    """--set KEY=VALUE: VALUE as JSON when it parses, else the string."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected KEY=VALUE")
    key, val = text.split("=", 1)
    try:
        return key, json.loads(val)
    except json.JSONDecodeError:
        return key, val


def register(subparsers) -> None:
    p = add_command(subparsers, "run", _main, help="the whole pipeline in one resumable command")
    add_flags(p.add_argument_group("target and data"), RunConfig, ["target", "data", "trust_remote_code"])
    recipe = p.add_argument_group("recipe")
    which = recipe.add_mutually_exclusive_group()
    add_flags(which, RunConfig, ["preset", "recipe_file"],
              preset={"default": None, "help": "a shipped recipe: cpu-demo, gpu or gpu-dflash (default: gpu when a "
                                               "CUDA GPU is present, else cpu-demo)"},
              recipe_file={"flags": ("--recipe",), "metavar": "FILE",
                           "help": "a recipe TOML file ([run], [prepare], [capture], [train], [[bench]]; docs/run.md)"})
    recipe.add_argument("--set", dest="overrides", action="append", type=parse_knob, default=[], metavar="KEY=VALUE",
                        help="change one recipe value, e.g. --set train.epochs=3 or --set prepare.limit=100; VALUE is "
                             "JSON (null for None); short names such as limit=100 work too (repeatable)")
    out = p.add_argument_group("output and progress")
    add_flags(out, RunConfig, ["out"], out={"default": None, "help": "run directory (default: runs/<preset or "
                                                                    "recipe name>)"})
    add_flags(out, RunConfig, ["overwrite", "quiet", "verbose", "until"], until={"choices": STAGES})


def _main(args) -> int:
    """prepare -> capture -> train -> bench -> export -> report.md, resumable by stage: the target and data, a preset
    or recipe, and --set for one value."""
    name = args.preset
    if args.recipe_file:
        name = Path(args.recipe_file).stem
    elif name is None:
        import torch
        name = "gpu" if torch.cuda.is_available() else "cpu-demo"
    cfg = from_args(RunConfig, args, preset=name, out=args.out or f"runs/{name}", overrides=dict(args.overrides))
    run_pipeline(cfg)
    return 0
