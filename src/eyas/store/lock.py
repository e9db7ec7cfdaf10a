"""One writer per store rank: an flock on STORE/.lock-rRRR that names its holder.

The kernel drops an flock when its process dies (kill -9 included), so a crashed capture never leaves a
stale lock: the file may stay behind, but the next run takes it. A live holder makes a second writer refuse
with the holder's pid, host, start time and command. Releasing unlinks the file before unlocking; a taker
checks that the file it locked is still the one at the path, so two takers can never both win.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from eyas.errors import EyasError

LOCK_RE = re.compile(r"^\.lock-r(\d{3})$")


def lock_name(rank: int) -> str:
    return f".lock-r{rank:03d}"


class StoreLock:
    """Held from acquire_store_lock() until release() (or the process's death)."""

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self._fd, self._created = path, fd, created   # created: the directories made, deepest first

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter then finds a new file, not this one
        os.close(self._fd)
        self._fd = None
        for d in self._created:  # a run that failed before writing anything leaves no empty store (or parent)
            try:
                d.rmdir()
            except OSError:
                break

    def __enter__(self) -> "StoreLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(p: Path) -> str:
    try:
        h = json.loads(p.read_text())
        return (f"pid {h['pid']} on {h['host']} (since {h['since']}, command: {h['command']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file does not say which)"


def acquire_store_lock(store, rank: int = 0) -> StoreLock:
    """Lock STORE for this rank's writer (creating STORE), or refuse naming the live holder."""
    store = Path(store)
    if store.exists() and not store.is_dir():
        raise EyasError(f"{store}: exists and is not a directory")
    created = [d for d in (store, *store.parents) if not d.exists()]   # deepest first
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EyasError(f"{store}: cannot create the store directory ({e.strerror or e})") from e
    p = store / lock_name(rank)
    while True:
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise EyasError(f"{p}: cannot create the writer lock ({e.strerror or e})") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EyasError(f"{store}: rank {rank} of this store is being written by {_holder(p)}; wait for it "
                            f"to finish or stop it (lock {p.name})") from None
        try:
            same = os.stat(p).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder released (and unlinked) between our open and our lock: take the new file
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    return StoreLock(p, fd, created)
