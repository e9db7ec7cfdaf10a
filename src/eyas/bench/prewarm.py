"""Bench warm-up in a background process: `eyas run` compiles the bench's graphs while the drafter trains.

A bench process that finds inductor's caches cold spends minutes compiling (BENCHMARKS.md); the train stage
before it keeps the GPU busy and the CPU mostly idle. So `eyas run` starts `python -m eyas.bench.prewarm SPEC
RESULT` at the start of the train stage: its own CUDA context, niced, in a session of its own. It opens the
target, builds a drafter of the exact config training will write (random weights: compiled code depends on
shapes and dtypes, not on weight values), and runs every pending bench's own set-up and warm-up
(`run_bench(..., warm_only=True)`), which leaves the FX-graph cache under $EYAS_CACHE/inductor (and, with
persist_steps, the saved steps) warm for the bench proper. RESULT gets one warm-up report per bench.

Parent side (`Prewarm`): start, a bounded wait before the bench stage, stop (its whole process group) when the
run ends or is interrupted. The child exits by itself when its parent dies (`watch_parent`), and a resumed run
stops a recorded one still alive (`stop_stale`), so a killed run leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

AUTO_SHARE = 0.05
"""Auto mode warms only when the warm-up's own copy of the target's weights takes at most this share of the GPU's
memory: beside training, a second copy of a large target could push training out of memory."""
WAIT_S = 300.0
"""Longest wait, after training, for an unfinished warm-up: about two cold compiles of a bench (BENCHMARKS.md);
the bench compiles what is left after that."""


# ---- the child --------------------------------------------------------------------------------------------------

def watch_parent(parent: int, every: float = 0.5) -> None:
    """Exit this process (no clean-up: it holds only caches, written atomically) once `parent` is no longer its
    parent: `eyas run` was killed."""
    def loop():
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(3)
    threading.Thread(target=loop, daemon=True, name="eyas-prewarm-watch").start()


def warm(spec: dict, out=None) -> dict:
    """Warm every bench of `spec` (see Prewarm.start) in this process; returns {"benches": {name: warm-up report}}."""
    import torch

    from eyas.bench.bench import BenchConfig, run_bench
    from eyas.model.dflash import DFlashConfig, DFlashDrafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from eyas.target import load_target

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    target = load_target(spec["target"], device=spec["device"], dtype=dtype,
                         trust_remote_code=spec.get("trust_remote_code", False))
    dc = spec["drafter"]  # the drafter config training writes, either kind
    drafter = (DFlashDrafter(DFlashConfig.from_dict(dc)) if dc.get("kind") == "dflash"
               else Eagle3Drafter(DrafterConfig.from_dict(dc))).to(target.device)  # fp32, as open_drafter's
    reports = {}
    for name, d in spec["benches"].items():
        cfg = BenchConfig.from_dict({**d, "json_out": None})
        reports[name] = run_bench(cfg, target=target, drafter=drafter, warm_only=True, out=out or sys.stdout)
    return {"benches": reports}


def main(argv: list[str] | None = None) -> int:
    spec_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    watch_parent(spec["parent"])
    os.nice(spec.get("nice", 10))  # the training process comes first; inductor's compile workers inherit this
    t0 = time.time()
    result = warm(spec)
    result["seconds"] = round(time.time() - t0, 1)
    from eyas.manifest import atomic_write_bytes
    atomic_write_bytes(Path(result_path), (json.dumps(result, indent=2) + "\n").encode())
    return 0


# ---- the parent -------------------------------------------------------------------------------------------------

def command(spec: Path, result: Path) -> list[str]:
    """The warm-up process's command line."""
    return [sys.executable, "-m", "eyas.bench.prewarm", str(spec), str(result)]


def fits_beside_training(target) -> bool:
    """Whether the warm-up's copy of `target`'s weights takes at most AUTO_SHARE of its GPU's memory (always, off
    a GPU)."""
    import torch

    if target.device.type != "cuda":
        return True
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    return weights <= AUTO_SHARE * torch.cuda.get_device_properties(target.device).total_memory


def planned_drafter_config(train, target):
    """The DrafterConfig the train stage of `train` (a TrainConfig) will write: train/setup.py run_drafter_config,
    the Trainer's own rule, on the config resolved for its device (and --init's vocabulary, if any)."""
    import torch

    from eyas.train.setup import run_drafter_config

    tcfg, _ = train.for_device(torch.device(train.device))
    init = None
    if tcfg.init:
        from eyas.model.checkpoint import open_drafter
        init = open_drafter(tcfg.init, target, allow_target_mismatch=tcfg.allow_target_mismatch)[0].config
    return run_drafter_config(tcfg, target, init)


def start(logs: Path, benches: dict, train, target, *, target_spec: str, dtype: str,
          trust_remote_code: bool = False) -> "Prewarm":
    """Start warming `benches` ({name: BenchConfig}) for the drafter `train` will write, in the background."""
    dcfg = planned_drafter_config(train, target)
    spec = {"target": anchored(target_spec), "device": next(iter(benches.values())).device, "dtype": dtype,
            "trust_remote_code": trust_remote_code, "drafter": json.loads(json.dumps(dcfg.to_dict())),
            "benches": {n: {**(d := b.to_dict()), **{k: anchored(d[k]) for k in ("target", "drafter", "prompts")}}
                        for n, b in benches.items()}}
    return Prewarm(logs, spec, cmd=command)  # looked up at call time: tests swap in a process made to fail


def anchored(spec: str | None) -> str | None:
    """A target, drafter or prompt spec whose relative path (also after `heldout:` or `long:`) exists here, made
    absolute: the warm-up runs in the run directory (Prewarm), where that path would name nothing. A name that is
    no path here (an embedded target, a prompt set, a hub id) stays as it is."""
    from eyas.bench.bench import PROMPT_SETS
    from eyas.target.load import EMBEDDED

    if not spec:
        return spec
    prefix, path = spec.split(":", 1) if spec.startswith(("heldout:", "long:")) else ("", spec)
    p = Path(path).expanduser()
    if path in EMBEDDED or path in PROMPT_SETS or path == "sharegpt" or p.is_absolute() or not p.exists():
        return spec
    return (prefix + ":" if prefix else "") + str(p.resolve())


def await_before_bench(proc: "Prewarm", log) -> dict:
    """Before the bench stage: wait for the warm-up (at most WAIT_S, then stop it), say in one log line how it went,
    and return what run.json records: Prewarm.record() plus finished_before_bench and waited_s."""
    return await_warmup(proc, log, WAIT_S, stage="bench", beside="training", marker="benches", who="the bench")


def await_warmup(proc: "Prewarm", log, wait_s: float, *, stage: str, beside: str, marker: str, who: str) -> dict:
    """Before `stage`: wait for the warm-up `proc` that ran beside `beside` (at most wait_s, then stop it), say in one
    log line how it went, and return Prewarm.record() plus finished_before_<stage> and waited_s. The warm-up worked
    when it exited 0 with `marker` in its result; otherwise `who` compiles for itself."""
    before = proc.done()
    t0 = time.time()
    ended = before or proc.wait(wait_s)
    rec = {**proc.record(), f"finished_before_{stage}": before, "waited_s": round(time.time() - t0, 1)}
    if not ended:
        log(f"{proc.name}: not finished after waiting {wait_s:.0f} s; stopped it, {who} compiles what is left",
            always=True)
    elif rec["returncode"] != 0 or marker not in rec:
        log(f"{proc.name}: failed (exit status {rec['returncode']}, logs/{proc.name}.log); {who} compiles its graphs "
            f"itself", always=True)
    else:
        log(f"{proc.name}: finished in {rec['seconds']:.0f} s, "
            + (f"before {beside} ended" if before else f"{rec['waited_s']:.0f} s after it"))
    return rec


def bench_digest(result: dict) -> dict:
    """What run.json keeps of the bench warm-up's result: each bench's warm-up report, seconds and compile cache."""
    return {"benches": {n: {"warmup": r["warmup"], "seconds": r["seconds"],
                            **({"compile_cache": r["compile_cache"]} if "compile_cache" in r else {})}
                        for n, r in result["benches"].items()}}


class Prewarm:
    """One warm-up process of a run directory: RUN/logs/NAME-spec.json in, NAME.json out, NAME.log (NAME "prewarm"
    for the bench's, "train-prewarm" for training's, eyas/train/prewarm.py); `digest` picks what run.json keeps of
    its result (bench_digest unless given)."""

    def __init__(self, logs: Path, spec: dict, cmd=command, name: str = "prewarm", digest=None):
        from eyas.target.fingerprint import cache_root

        logs = Path(logs).resolve()  # the process runs in the run directory (below): its arguments are absolute
        self.name, self.digest = name, digest or bench_digest
        self.spec_path, self.result_path = logs / f"{name}-spec.json", logs / f"{name}.json"
        self.drafter_config = spec.get("drafter")
        self.result_path.unlink(missing_ok=True)
        self.spec_path.write_text(json.dumps({**spec, "parent": os.getpid()}, indent=2) + "\n")
        self.started = time.time()
        self.ended: float | None = None
        # cwd: the run directory, which outlives the process. Inherited, the cwd of `eyas run` may be deleted while
        # the run goes on (a working tree laid anew), and a Python started in a deleted directory cannot import
        # torch ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"); so the spec's paths are absolute
        # (anchored) and so is the compile cache both processes share.
        env = {**os.environ, "EYAS_CACHE": str(cache_root().resolve())}
        with open(logs / f"{name}.log", "ab") as log:
            self.proc = subprocess.Popen(cmd(self.spec_path, self.result_path), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=logs.parent, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def done(self) -> bool:
        if self.proc.poll() is not None and self.ended is None:
            self.ended = time.time()
        return self.ended is not None

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the process to end; False (and the process stopped) if it did not."""
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.stop()
            return False
        self.done()
        return True

    def stop(self) -> None:
        """End the process and its compile workers (its process group): SIGTERM, then SIGKILL after 5 s."""
        if self.proc.poll() is None:
            _kill_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.done()

    def record(self) -> dict:
        """What run.json keeps: pid, seconds, exit status and, when it finished, digest(its result)."""
        rc = self.proc.poll()
        rec = {"pid": self.pid, "seconds": round((self.ended or time.time()) - self.started, 1), "returncode": rc}
        if rc == 0 and self.result_path.exists():
            rec.update(self.digest(json.loads(self.result_path.read_text())))
        return rec


def _kill_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_stale(pid: int, logs: Path, name: str = "prewarm") -> bool:
    """Stop a warm-up process a killed run left running: only if `pid` still leads its own process group and its
    command line names this run's LOGS/NAME-spec.json (so never an unrelated process that reused the pid).
    True if one was stopped."""
    spec_path = logs / f"{name}-spec.json"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if os.getpgid(pid) != pid or str(spec_path).encode() not in cmdline:
            return False
    except OSError:  # gone, or no /proc: nothing to stop here
        return False
    _kill_group(pid, signal.SIGTERM)
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    _kill_group(pid, signal.SIGKILL)
    return True


if __name__ == "__main__":
    sys.exit(main())
