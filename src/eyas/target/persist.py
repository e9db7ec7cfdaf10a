"""Compiled runner steps kept on disk: a later process loads them instead of tracing them again.

With a warm inductor cache, a bench process still pays dynamo's trace of every compiled whole-model step (the warm-cache column of
BENCHMARKS.md#runner-compile-variants-compile_variantspy---variant-timeout-240---variants-wholegemvgemv8-4871fe7). `torch.compile(fn).aot_compile`
(torch >= 2.11; public from 2.12) traces and compiles once for one call signature and saves the result; the
saved function reads the runner's weights and caches from its argument at call time (they are not in the file)
and mutates the caches in place, so it serves any runner of the same configuration.

A file is named by everything that shapes its code: the step function, the call signature (each tensor's shape,
strides, dtype and device, which arguments share storage, and the global state dynamo guards on: threads, TF32,
default dtype, deterministic mode), the runner's configuration and compile settings, the device model, torch's
and Python's versions and a hash of eyas's own source. A saved function still checks its argument guards on
every call and raises where plain torch.compile would recompile; so every function is checked against the call
first, and one that does not fit is compiled again, or, if a fresh compile does not fit either or cannot be made
(aot_compile raises), replaced by plain torch.compile for that signature (said on stderr). A file that does not
load is compiled again and replaced. Calls run under `no_grad`, the mode they were compiled in.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor


@lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 of every .py file of the eyas package: any code change names new files."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def supported() -> bool:
    """Whether this torch can save and load compiled functions (probed once per process)."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return False
    if hasattr(torch._dynamo.config, "enable_aot_compile"):  # torch 2.11: behind this switch
        torch._dynamo.config.enable_aot_compile = True
    return hasattr(torch.compile(lambda: None), "aot_compile")


def signature(args) -> tuple:
    """What a call's arguments and the process state fix in the compiled code (the file name's part per call)."""
    first: dict[int, int] = {}
    desc = []
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            shared = first.setdefault(a.untyped_storage().data_ptr(), i)  # arguments sharing storage: aliasing
            desc.append((tuple(a.shape), a.stride(), str(a.dtype), str(a.device), a.requires_grad, shared))
        else:
            desc.append(repr(a))
    state = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             str(torch.get_default_dtype()), torch.are_deterministic_algorithms_enabled())
    return tuple(desc) + (state,)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


class Unpickled(dict):
    """A dict that pickles as an empty one. aot_compile of a step whose argument is a runner pickles the guard state
    reachable from that runner, its plain dicts and closures included; what a runner keeps of its compiled and
    captured steps cannot be pickled (a loaded function's guard manager: "cannot pickle 'RootGuardManager'"; a CUDA
    graph: "cannot pickle 'CUDAGraph' object"), so it keeps them in one of these."""

    def __reduce__(self):
        return type(self), ()


class PersistentStep:
    """`fn(owner, *args, *extra)` compiled for each call signature, loaded from `directory` when a file for it
    exists, else compiled (`aot_compile`) and saved there."""

    def __init__(self, fn, owner, directory, config: str, options: dict | None = None, extra: tuple = ()):
        self.fn, self.owner, self.dir, self.options, self.extra = fn, owner, Path(directory), options, extra
        self.config = config
        self.loaded = self.compiled = self.fallbacks = 0  # files loaded / compiled and saved / plain compiles
        self._steps: dict = Unpickled()  # call signature -> its function

    def __call__(self, *args):
        full = (self.owner, *args, *self.extra)
        with torch.no_grad():
            key = signature(args)
            step = self._steps.get(key)
            if step is None:
                step = self._steps[key] = self._resolve(full, key)
            return step(*full)

    def path_for(self, key: tuple) -> Path:
        dev = self.owner.device
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
        text = "\n".join([self.fn.__module__, self.fn.__qualname__, repr(key), repr(self.extra), self.config,
                          repr(sorted((self.options or {}).items())), where, torch.__version__, sys.version,
                          source_hash()])
        return self.dir / f"{self.fn.__name__}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"

    def _resolve(self, full, key):
        path = self.path_for(key)
        if path.exists():
            try:
                with open(path, "rb") as f:
                    step = torch.compiler.load_compiled_function(f)
                if step.guard_check(*full):
                    self.loaded += 1
                    return step
                why = "its guards do not fit this call"
            except Exception as e:  # noqa: BLE001 - a stale or torn file is compiled again, never trusted
                why = f"{type(e).__name__}: {_first_line(e)}"
            print(f"eyas: {path}: could not use the saved compiled step ({why}); compiling it again", file=sys.stderr)
        try:
            step = torch.compile(self.fn, fullgraph=True, dynamic=False, options=self.options or None).aot_compile(
                (full, {}))
            why = None if step.guard_check(*full) else "its saved form does not fit its own call"
        except Exception as e:  # noqa: BLE001 - e.g. guard state that cannot be pickled; a real trace error
            why = f"{type(e).__name__}: {_first_line(e)}"  # is raised again by the plain compile below
        if why is not None:
            print(f"eyas: {path.name}: this step cannot be saved ({why}); using plain torch.compile for it",
                  file=sys.stderr)
            self.fallbacks += 1
            return torch.compile(self.fn, fullgraph=True, dynamic=False, options=self.options or None)
        self.compiled += 1
        self._save(step, path)
        return step

    def _save(self, step, path: Path) -> None:
        """Into a private directory beside `path`, then renamed over it: a killed or failed save leaves no file
        under a real name, and nothing of torch's own temporary files."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".saving-", dir=self.dir))
        except OSError as e:
            print(f"eyas: {self.dir}: could not save the compiled step ({e}); it is used unsaved", file=sys.stderr)
            return
        try:
            step.save_compiled_function(str(tmp / path.name))
            os.replace(tmp / path.name, path)
        except Exception as e:  # noqa: BLE001 - a failed save costs the next process a compile, not this run
            print(f"eyas: {path}: could not save the compiled step ({type(e).__name__}: {e}); it is used unsaved",
                  file=sys.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
