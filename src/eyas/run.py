"""`eyas run`: prepare -> capture (or online) -> train -> bench -> export -> report, resumable by stage.

RUN/
  run.json        resolved config + per-stage status (the resume record)
  prepared/       eyas prepare output           store/    eyas capture output (offline presets)
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eyas.errors import EyasError
from eyas.manifest import atomic_write_bytes, diff_dicts

# Every knob a preset sets. A user changes a preset by editing a copy of it, or with the flags below.
PRESETS: dict[str, dict] = {
    # 2 CPU cores, under 20 minutes: short first-turn conversations (max_len is the whole conversation's token
    # budget); the replies of the first 900 regenerated greedily by the target, the next ones kept as written (more
    # distinct text for the same budget: the labels come from the target either way); a small draft vocabulary and
    # few TTT steps. A demonstration, not a production drafter.
    "cpu-demo": dict(
        device="cpu", dtype="bf16", bench_dtype="fp32", autocast="bf16", limit=1600, max_len=416, max_turns=1,
        regenerate=True, regen_limit=900, max_new_tokens=96, regen_batch=256, gen_batch=32, regen_dtype=None,
        samples_per_prompt=1, regen_temperature=0.0, self_prompts=0, capture=True, capture_dtype="bf16",
        online=False, draft_vocab=8192, ttt_steps=3, epochs=2, steps=None, lr=3e-3, batch_tokens=2048,
        chunk_size=None, loss_on="assistant", pack="off", attention="auto", compile=False, eval_every=0,
        bench=[dict(prompts="heldout", method="chain", k=5, limit=20, max_turns=1, max_new_tokens=64)],
    ),
    # One H200, stages sized for about 15 minutes (issue 12; not yet measured end to end): every assistant turn
    # of the first three regenerated in context within a 2048-token budget, trained online (the 135M target's
    # forward is cheap inside a step; no store) on packed 2048-token rows with block-sparse flex attention, the
    # fused LM head and a compiled decoder layer (111k tok/s measured, BENCHMARKS.md), held-out eval every 100
    # steps for the scaling curve, benched with chains and the tree on two prompt sets.
    "gpu": dict(
        device="cuda", dtype="bf16", bench_dtype="bf16", autocast="auto", limit=None, max_len=2048, max_turns=3,
        regenerate=True, regen_limit=None, max_new_tokens=384, regen_batch=4096, gen_batch=512, regen_dtype=None,
        samples_per_prompt=1, regen_temperature=0.0, self_prompts=0, capture=False, capture_dtype="bf16",
        online=True, draft_vocab=32000, ttt_steps=6, epochs=3, steps=None, lr=1e-3, batch_tokens=32768,
        chunk_size=None, loss_on="assistant", pack="on", attention="flex", compile=True, eval_every=100,
        bench=[dict(prompts="heldout", method="chain", k=3, limit=30, max_turns=1, max_new_tokens=256),
               dict(prompts="heldout", method="chain", k=5, limit=30, max_turns=1, max_new_tokens=256),
               dict(prompts="heldout", method="tree", k=5, limit=10, max_turns=1, max_new_tokens=128),
               dict(prompts="humaneval", method="chain", k=5, limit=30, max_turns=1, max_new_tokens=256)],
    ),
}
STAGES = ("prepare", "capture", "train", "bench", "export")


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    target: str = "smollm2-135m"
    """Target model (embedded name, HF dir, hub id, GGUF)."""
    data: str = "sharegpt"
    """Conversations (`sharegpt` or a ShareGPT .json / OpenAI .jsonl path)."""
    preset: str = "cpu-demo"
    """cpu-demo or gpu."""
    out: str = "runs/eyas-run"
    """Run directory."""
    overrides: dict = field(default_factory=dict)
    """Preset knobs changed on the command line (e.g. {"limit": 50})."""
    overwrite: bool = False
    """Delete a run directory of another configuration instead of refusing."""
    quiet: bool = False
    """No progress bars; only the final summary."""
    until: str | None = None
    """Stop after this stage (e.g. to fit a job into time slices); a rerun without it continues."""

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise EyasError(f"unknown preset {self.preset!r}: expected one of {', '.join(PRESETS)}")
        if self.until is not None and self.until not in STAGES:
            raise EyasError(f"--until {self.until!r}: expected one of {', '.join(STAGES)}")
        unknown = set(self.overrides) - set(PRESETS[self.preset])
        if unknown:
            raise EyasError(f"unknown preset knob(s) {sorted(unknown)}")
        for key, value in self.overrides.items():
            _check_knob(key, value, PRESETS[self.preset][key])

    @property
    def knobs(self) -> dict:
        return {**PRESETS[self.preset], **self.overrides}

    def identity(self) -> dict:
        """What must match for a rerun to resume this run directory."""
        return {"target": self.target, "data": self.data, "preset": self.preset, "knobs": self.knobs}


def _check_knob(key: str, value, default) -> None:
    """A --set value must have the type of the preset's value (an int is a float; None stays free)."""
    if default is None or value is None:
        return
    want = type(default)
    ok = (isinstance(value, want) and not (want is int and isinstance(value, bool))) or (
        want is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise EyasError(f"--set {key}={json.dumps(value)}: expected {want.__name__} like the preset's "
                        f"{json.dumps(default)}, got {type(value).__name__}")


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


def _open_state(cfg: RunConfig, run: Path) -> dict:
    path = run / "run.json"
    if path.exists():
        state = json.loads(path.read_text())
        diffs = diff_dicts(state["identity"], cfg.identity())
        if diffs and not cfg.overwrite:
            raise EyasError(f"{run}: holds a run of another configuration ({'; '.join(diffs)}); "
                            f"use another --out or pass --overwrite")
        if not diffs:
            return state
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    return {"identity": cfg.identity(), "stages": {}, "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def _save_state(run: Path, state: dict) -> None:
    atomic_write_bytes(run / "run.json", (json.dumps(state, indent=2) + "\n").encode())


def _verify(stage: str, run: Path, target) -> None:
    """Raise if a finished stage's output no longer checks out (then the stage is redone)."""
    if stage == "prepare":
        from eyas.data.prepared import PreparedData
        PreparedData(run / "prepared", target=target)
    elif stage == "capture":
        from eyas.store.reader import Store
        Store(run / "store", target=target).verify()
    elif stage == "train":
        from eyas.model.drafter import load_drafter
        load_drafter(run / "train" / "drafter")
    elif stage == "bench":
        for p in (run / "bench").glob("*.json"):
            json.loads(p.read_text())
    elif stage == "export":
        from eyas.model.importer import load_eagle3_checkpoint
        load_eagle3_checkpoint(run / "export", target=target)


def run_pipeline(cfg: RunConfig) -> dict:
    """Run (or resume) every stage; returns the run state with each stage's summary."""
    import torch

    from eyas.target import load_target

    k = cfg.knobs
    if k["device"] == "cuda" and not torch.cuda.is_available():
        raise EyasError(f"preset {cfg.preset!r} needs a CUDA GPU and none is available; use --preset cpu-demo")
    run = Path(cfg.out)
    state = _open_state(cfg, run)
    log = Log(run, cfg.quiet)
    _save_state(run, state)
    t_start = time.time()
    log(f"eyas run: preset {cfg.preset}, target {cfg.target}, data {cfg.data} -> {run}", always=True)
    if cfg.preset == "cpu-demo":
        log("this is a demonstration on the CPU (small data, short training); for a real drafter run "
            "`eyas run --preset gpu` on a CUDA machine", always=True)

    target = load_target(cfg.target, device=k["device"], dtype=_dtype(k["dtype"]))
    progress = not cfg.quiet
    stages = [s for s in STAGES if s != "capture" or k["capture"]]
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
        log(f"{stage}: starting" + (" (resuming)" if (run / _stage_dir(stage)).exists() else ""))
        t0, before = time.time(), st.get("seconds", 0.0) if not st.get("done") else 0.0
        try:
            summary = STAGE_FUNCS[stage](cfg, k, run, target, progress, redo=bool(st.get("redo")))
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
    state["wall_seconds_this_invocation"] = round(time.time() - t_start, 1)
    _save_state(run, state)
    if cfg.until is not None and not all(state["stages"].get(s, {}).get("done") for s in stages):
        log(f"stopped after {cfg.until} (--until); rerun without --until to continue", always=True)
        return state
    from eyas.report import write_report
    summary = write_report(run, state, cfg)
    log("report: " + str(run / "report.md"), always=True)
    print(summary, flush=True)
    return state


def _stage_dir(stage: str) -> str:
    return {"prepare": "prepared", "capture": "store"}.get(stage, stage)


def _prepare(cfg, k, run, target, progress, redo=False) -> dict:
    from eyas.data.prepare import PrepareConfig, run_prepare

    pc = PrepareConfig(target=cfg.target, data=cfg.data, out=str(run / "prepared"), limit=k["limit"],
                       max_len=k["max_len"], regenerate=k["regenerate"], regenerate_limit=k["regen_limit"],
                       max_new_tokens=k["max_new_tokens"], batch_size=k["regen_batch"], max_turns=k["max_turns"],
                       regen_dtype=k["regen_dtype"], gen_batch=k["gen_batch"], samples_per_prompt=k["samples_per_prompt"],
                       regen_temperature=k["regen_temperature"], self_prompts=k["self_prompts"], overwrite=redo)
    return run_prepare(pc, target, progress=progress)["counts"]


def _capture(cfg, k, run, target, progress, redo=False) -> dict:
    from eyas.capture.capture import CaptureConfig, run_capture

    cc = CaptureConfig(out=str(run / "store"), target=cfg.target, data=str(run / "prepared"),
                       dtype=k["capture_dtype"], device=k["device"], overwrite=redo, progress=progress)
    m = run_capture(cc, target)
    from eyas.store.reader import Store
    return Store(run / "store", target=target).info()


def _train(cfg, k, run, target, progress, redo=False) -> dict:
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import run_train

    src = dict(data=str(run / "prepared")) if k["online"] else dict(store=str(run / "store"))
    out = run / "train"
    resume = out.exists() and not redo
    if redo:
        shutil.rmtree(out, ignore_errors=True)
    tc = TrainConfig(out=str(out), target=cfg.target, epochs=k["epochs"], steps=k["steps"], lr=k["lr"],
                     ttt_steps=k["ttt_steps"], draft_vocab=min(k["draft_vocab"], target.vocab_size),
                     batch_tokens=k["batch_tokens"], chunk_size=k["chunk_size"], max_len=k["max_len"],
                     device=k["device"], autocast=k["autocast"], loss_on=k["loss_on"], pack=k["pack"],
                     attention=k["attention"], compile=k["compile"], eval_every=k["eval_every"], checkpoint_every=50,
                     resume=resume, progress=progress, **src)
    return run_train(tc, target)


def _bench(cfg, k, run, target, progress, redo=False) -> dict:
    from eyas.bench.bench import BenchConfig, run_bench
    from eyas.model.importer import load_any_drafter

    if k["bench_dtype"] != k["dtype"]:  # e.g. an exact fp32 lossless check after bf16 data and training
        from eyas.target import load_target
        target = load_target(cfg.target, device=k["device"], dtype=_dtype(k["bench_dtype"]))
    drafter, meta = load_any_drafter(str(run / "train"), target=target)
    drafter = drafter.to(target.device)
    out, results = run / "bench", {}
    out.mkdir(exist_ok=True)
    sink = open(run / "logs" / "bench.log", "a")
    try:
        for b in k["bench"]:
            # "heldout" = the held-out split of the run's own data, which prepare never wrote
            prompts = b["prompts"]
            if prompts == "heldout":
                prompts = "sharegpt-heldout" if cfg.data == "sharegpt" else f"heldout:{cfg.data}"
            label = "sharegpt-heldout" if prompts == "sharegpt-heldout" else (
                "heldout" if prompts.startswith("heldout:") else Path(prompts).stem)
            name = f"{label}-{b['method']}" + (f"{b['k']}" if b["method"] == "chain" else "")
            path = out / f"{name}.json"
            if path.exists() and not redo:
                results[name] = json.loads(path.read_text())
                continue
            bc = BenchConfig(target=cfg.target, prompts=prompts, method=b["method"], k=b["k"], limit=b["limit"],
                             max_turns=b.get("max_turns"),
                             # prompts that leave room for a reply inside the training budget (RoPE positions seen)
                             max_prompt_tokens=max(1, k["max_len"] - k["max_new_tokens"]),
                             max_new_tokens=b["max_new_tokens"], device=k["device"], json_out=str(path),
                             compile=k["device"] == "cuda")
            results[name] = run_bench(bc, target=target, drafter=drafter, drafter_meta=meta,
                                      out=sink if cfg.quiet else sys.stdout)
    finally:
        sink.close()
    return {n: {m: {key: r["methods"][m].get(key) for key in ("tau", "tokens_per_s", "speedup")}
                for m in r["methods"]} | {"lossless": r.get("lossless")} for n, r in results.items()}


def _export(cfg, k, run, target, progress, redo=False) -> dict:
    from eyas.export.export import export_drafter, resolve_drafter_dir
    from eyas.model.drafter import load_drafter
    from eyas.target.load import resolve

    drafter, meta = load_drafter(resolve_drafter_dir(run / "train"))
    served = str(resolve(cfg.target)[0])  # the engines need an HF directory (the GGUF's safetensors cache)
    chain = max((b["k"] for b in k["bench"] if b["method"] == "chain"), default=3)
    path = export_drafter(drafter, run / "export", meta=meta, target=target, target_ref=served,
                          num_speculative_tokens=chain)
    return {"path": str(path), "served_target": served}


STAGE_FUNCS = {"prepare": _prepare, "capture": _capture, "train": _train, "bench": _bench, "export": _export}


def _knob(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected KEY=VALUE")
    key, val = text.split("=", 1)
    try:
        return key, json.loads(val)
    except json.JSONDecodeError:
        return key, val


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="the whole pipeline in one resumable command",
                              description="prepare -> capture -> train -> bench -> export -> report.md")
    p.add_argument("--target", default="smollm2-135m", help="target model (default: the embedded SmolLM2-135M)")
    p.add_argument("--data", default="sharegpt", help="conversations (default: the embedded ShareGPT)")
    p.add_argument("--preset", default=None, choices=None,
                   help="cpu-demo or gpu (default: gpu when a CUDA GPU is present, else cpu-demo)")
    p.add_argument("--out", default=None, help="run directory (default: runs/<preset>)")
    p.add_argument("--set", dest="overrides", action="append", type=_knob, default=[], metavar="KEY=VALUE",
                   help="change one preset knob, e.g. --set limit=100 (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace a run directory of another configuration")
    p.add_argument("--quiet", action="store_true", help="no progress bars, only the summary")
    p.add_argument("--until", choices=STAGES, help="stop after this stage (a rerun without it continues)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    preset = args.preset
    if preset is None:
        import torch
        preset = "gpu" if torch.cuda.is_available() else "cpu-demo"
    cfg = RunConfig(target=args.target, data=args.data, preset=preset, out=args.out or f"runs/{preset}",
                    overrides=dict(args.overrides), overwrite=args.overwrite, quiet=args.quiet, until=args.until)
    run_pipeline(cfg)
    return 0
