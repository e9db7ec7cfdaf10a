"""A warm-up process beside a stage of `eyas run`: the bench's (bench/prewarm.py) and training's (train/prewarm.py)
compile caches are filled by a child process of their own while an earlier stage runs.

Parent side (`Prewarm`): start, a bounded wait before the stage (`await_warmup`), stop (its whole process group)
when the run ends or is interrupted. The child exits by itself when its parent dies (`watch_parent`), and a resumed
run stops a recorded one still alive (`stop_stale`), so a killed run leaves no process behind.

Its imports are the standard library's at the top: the child imports this module and starts `watch_parent` before
torch loads (eyas.target loads it), so that a parent killed meanwhile is still seen.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path


def watch_parent(parent: int, every: float = 0.5) -> None:
    """Exit this process (no clean-up: it holds only caches, written atomically) once `parent` is no longer its
    parent: `eyas run` was killed."""
    def loop():
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(3)
    threading.Thread(target=loop, daemon=True, name="eyas-prewarm-watch").start()


def anchored(spec: str | None, keep: tuple[str, ...] = ()) -> str | None:
    """A target, drafter or prompt spec whose relative path (also after `heldout:` or `long:`) exists here, made
    absolute: the warm-up runs in the run directory (Prewarm), where that path would name nothing. A name that is
    no path here (an embedded target, a name in `keep`, a hub id) stays as it is."""
    from eyas.target.load import EMBEDDED

    if not spec:
        return spec
    prefix, path = spec.split(":", 1) if spec.startswith(("heldout:", "long:")) else ("", spec)
    p = Path(path).expanduser()
    if path in EMBEDDED or path in keep or p.is_absolute() or not p.exists():
        return spec
    return (prefix + ":" if prefix else "") + str(p.resolve())


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


class Prewarm:
    """One warm-up process of a run directory: RUN/logs/NAME-spec.json in, NAME.json out, NAME.log (NAME "prewarm"
    for the bench's, eyas/bench/prewarm.py, "train-prewarm" for training's, eyas/train/prewarm.py); `cmd(spec,
    result)` is its command line; `digest` picks what run.json keeps of its result (all of it unless given)."""

    def __init__(self, logs: Path, spec: dict, cmd, name: str = "prewarm", digest=None):
        from eyas.target.fingerprint import cache_root

        logs = Path(logs).resolve()  # the process runs in the run directory (below): its arguments are absolute
        self.name, self.digest = name, digest or dict
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
