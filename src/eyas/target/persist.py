"""Compiled runner steps kept on disk: a later process loads them instead of tracing them again.

With a warm inductor cache, a bench process still pays dynamo's trace of every compiled whole-model step (about
5 s each for SmolLM2's 30 layers; BENCHMARKS.md, compile_variants' warm column). `torch.compile(fn).aot_compile`
(torch >= 2.11; public from 2.12) traces and compiles once for one input signature and saves the result; the
saved function reads the runner's weights and caches from its argument at call time (they are not in the file)
and mutates the caches in place, so it serves any runner of the same configuration.

A file is named by everything that shapes its code: the step function, the input signature, the runner's
configuration and compile settings, the device, torch's version and a hash of eyas's own source. A file that
does not load is compiled again and replaced. Saved functions skip the guards dynamo cannot save: a call with
another signature never reaches a file (the signature names it), and calls run under `no_grad`, the mode they
were compiled in.
"""

from __future__ import annotations

import hashlib
import os
import sys
import weakref
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


def _describe(a) -> str:
    if isinstance(a, Tensor):
        return f"T{tuple(a.shape)}:{a.dtype}:{a.device.type}"
    return repr(a)


# The loaded functions of each PersistentStep, by input signature. Kept off the object (which the runner holds):
# a later aot_compile of this runner serialises guard state reachable from it, and a loaded function's guard
# manager cannot be pickled (torch 2.13: "cannot pickle 'RootGuardManager'").
_STEPS: dict[int, dict] = {}


class PersistentStep:
    """`fn(owner, *args, *extra)` compiled for each input signature, loaded from `directory` when a file for it
    exists, else compiled (`aot_compile`) and saved there."""

    def __init__(self, fn, owner, directory, signature: str, options: dict | None = None, extra: tuple = ()):
        self.fn, self.owner, self.dir, self.options, self.extra = fn, owner, Path(directory), options, extra
        self.signature = signature
        _STEPS[id(self)] = {}
        weakref.finalize(self, _STEPS.pop, id(self), None)
        self.loaded = self.compiled = 0  # files loaded / compiled and saved by this object

    def __call__(self, *args):
        key = tuple(_describe(a) for a in args)
        steps = _STEPS[id(self)]
        step = steps.get(key)
        if step is None:
            step = steps[key] = self._resolve(args, key)
        with torch.no_grad():
            return step(self.owner, *args, *self.extra)

    def path_for(self, key: tuple) -> Path:
        dev = self.owner.device
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
        text = "\n".join([self.fn.__module__, self.fn.__qualname__, repr(key), repr(self.extra), self.signature,
                          repr(sorted((self.options or {}).items())), where, torch.__version__, sys.version,
                          source_hash()])
        return self.dir / f"{self.fn.__name__}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"

    def _resolve(self, args, key):
        path = self.path_for(key)
        if path.exists():
            try:
                with open(path, "rb") as f:
                    step = torch.compiler.load_compiled_function(f)
                self.loaded += 1
                return step
            except Exception as e:  # noqa: BLE001 - a stale or torn file is compiled again, never trusted
                print(f"eyas: {path}: could not load a saved compiled step ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); compiling it again",
                      file=sys.stderr)
        with torch.no_grad():
            step = torch.compile(self.fn, fullgraph=True, dynamic=False, options=self.options or None).aot_compile(
                ((self.owner, *args, *self.extra), {}))
        self.compiled += 1
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            step.save_compiled_function(str(tmp))
            os.replace(tmp, path)  # whole or absent: a killed process leaves no torn file under the real name
        except OSError as e:  # a full disk costs the next process a compile, not this one its run
            tmp.unlink(missing_ok=True)
            print(f"eyas: {path}: could not save the compiled step ({e}); it is used unsaved", file=sys.stderr)
        return step
