"""Who writes which rank of an engine-capture store, under store/lock.py's per-rank flock.

- Rank 0 is the capture client (`eyas capture --engine`, `eyas engine ingest-vllm`). It creates and checks the
  store, writes vLLM's files and finalizes. It holds `.lock-r000` for its whole run, so a second capture into the
  same directory, engine or in-process (also rank 0), is refused with the holder named, both ways round.
- SGLang's hook in attention-DP group g writes as rank g + 1 (`hook_rank`). It holds its lock from its first
  accepted sample to its next flush; a second server writing into the store as the same rank is refused.
- The client's rank-0 StoreWriter has world size 1, so it deletes the temp files of every rank. While it runs
  (store creation, vLLM ingest, finalize) the client also holds the locks of every hook rank the store shows
  (`hook_ranks_held`). A hook still writing then makes the client wait, and after `wait_s` refuse, naming it.
"""

from __future__ import annotations

import re
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from eyas.errors import EyasError
from eyas.store import format as fmt
from eyas.store.lock import LOCK_RE, acquire_store_lock

CLIENT_RANK = 0
HOOK_RANK_OFFSET = 1     # the hook of attention-DP group g writes store rank g + 1
_EVENTS_RE = re.compile(r"^engine-events-r(\d{3})\.jsonl$")   # sglang_hook.events_name(dp rank)
_TEMP_RE = re.compile(r"^\.shard-r(\d{3})-")


def hook_rank(dp_rank: int) -> int:
    return dp_rank + HOOK_RANK_OFFSET


def hook_ranks(store) -> set[int]:
    """The store ranks written by hooks that this store shows: lock, shard and temp files, hook event logs."""
    ranks = set()
    for p in Path(store).iterdir() if Path(store).is_dir() else ():
        for rx, shift in ((LOCK_RE, 0), (fmt.SHARD_RE, 0), (fmt.SIDECAR_RE, 0), (_TEMP_RE, 0),
                          (_EVENTS_RE, HOOK_RANK_OFFSET)):
            m = rx.match(p.name)
            if m:
                ranks.add(int(m.group(1)) + shift)
    return {r for r in ranks if r != CLIENT_RANK}


@contextmanager
def hook_ranks_held(store, wait_s: float, poll_s: float = 0.2):
    """Hold the lock of every hook rank of `store` for the block (see the module doc); wait up to `wait_s`
    for a hook that is writing, then refuse naming it."""
    deadline = time.monotonic() + wait_s
    with ExitStack() as held:
        for r in sorted(hook_ranks(store)):
            while True:
                try:
                    held.enter_context(acquire_store_lock(store, r))
                    break
                except EyasError as e:
                    if time.monotonic() >= deadline:
                        raise EyasError(f"{e}; a serving engine's capture hook is still writing into this store "
                                        f"(waited {wait_s:g} s)") from None
                    time.sleep(poll_s)
        yield


@contextmanager
def client_writer(store, header: dict, *, wait_s: float, setup: bool = False):
    """The client's rank-0 StoreWriter, opened and closed with the hook ranks held (it cleans their temp files)."""
    from eyas.store.writer import StoreWriter  # noqa: PLC0415
    with hook_ranks_held(store, wait_s):
        w = StoreWriter(store, header=header, setup=setup)
        try:
            yield w
        except BaseException:
            w.abort()
            raise
        w.close()


def finalize_store(store, header: dict, expected_ids, *, wait_s: float) -> dict:
    """Mark STORE complete if it holds exactly `expected_ids`, with no hook writing meanwhile (a hook's shard
    committed during finalize would rewrite the manifest as incomplete)."""
    from eyas.store.writer import StoreWriter  # noqa: PLC0415
    with hook_ranks_held(store, wait_s):
        w = StoreWriter(store, header=header, setup=False)
        w.close()
        return w.finalize(set(expected_ids))
