"""Input prefetch: while step N runs, a background thread prepares the host side of step N+1's input (the store
read, the dtype conversion, the padded and, on CUDA, pinned tensors), so an input slower than zero but faster than
the step costs the training loop nothing.

The thread only runs `make(job)` on the jobs it is given, in their order, at most `depth` jobs ahead of the last
one taken; what comes next (the batch plan) is fixed by the caller before the thread starts, and the data position
in checkpoints stays the step's, never the prefetcher's. Whatever `make` raises (a corrupt shard, a bad sample) is
raised again, the same exception object, by the get() that asks for that job, in the caller's thread; close() (the
caller's `finally`, so also after an exception or a KeyboardInterrupt in a step) stops the thread and joins it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Hashable, Iterable

import torch

THREAD_NAME = "eyas-prefetch"
_END = object()
_POLL_S = 0.05   # how often a blocked thread looks at the stop flag


class Prefetcher:
    """`jobs` yields (key, job); get(key) returns make(job) for the next job, which must have that key.

    wait_s: seconds get() has blocked so far (the time the caller waited for its input). device: a CUDA device
    becomes the thread's current device (CUDA's is per thread), so that pinning never touches another GPU."""

    def __init__(self, jobs: Iterable[tuple[Hashable, object]], make: Callable, *, depth: int = 1,
                 name: str = THREAD_NAME, device: torch.device | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._jobs, self._make, self._device = iter(jobs), make, device
        self._ready: queue.Queue = queue.Queue()
        self._credit = threading.Semaphore(depth)     # jobs the thread may make before the caller takes one
        self._stop = threading.Event()
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            while self._acquire():
                item = next(self._jobs, _END)
                if item is _END:
                    break
                key, job = item
                self._ready.put((key, self._make(job), None))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread unchanged
            self._ready.put((None, None, e))
            return
        self._ready.put((None, _END, None))

    def _acquire(self) -> bool:
        """Wait for a credit; False once close() was called."""
        while not self._stop.is_set():
            if self._credit.acquire(timeout=_POLL_S):
                return not self._stop.is_set()
        return False

    def get(self, key: Hashable):
        """The result for the next job (its key must be `key`); raises what making it raised."""
        t0 = time.perf_counter()
        got, out, err = self._ready.get()
        self.wait_s += time.perf_counter() - t0
        if err is not None:
            self.close()
            raise err
        assert out is not _END and got == key, f"prefetch: asked for {key!r}, the plan's next job is {got!r}"
        self._credit.release()
        return out

    def close(self) -> None:
        """Stop the thread (it finishes the job it is making) and join it. Idempotent."""
        self._stop.set()
        self._credit.release()                       # wake a thread waiting for a credit
        self._thread.join()
        while not self._ready.empty():               # drop prepared results (pinned buffers) now
            self._ready.get_nowait()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
