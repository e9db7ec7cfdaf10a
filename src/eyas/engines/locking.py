"""Who writes which rank of an engine-capture store, under store/lock.py's per-rank flock.

- Rank 0 is the capture client (`eyas capture --engine`, `eyas engine ingest-vllm`). It creates and checks the
  store, writes vLLM's files and finalizes. It holds `.lock-r000` for its whole run, so a second capture into the
  same directory, engine or in-process (also rank 0), is refused with the holder named, both ways round.
- SGLang's hook in attention-DP group g writes as rank g + 1 (`hook_rank`). It holds its lock from its first
  accepted sample to its next flush; a second server writing into the store as the same rank is refused.
- The client's rank-0 StoreWriter has world size 1, so it deletes the temp files of every rank. While it runs
  (store creation, vLLM ingest, finalize) the client also holds the locks of every hook rank the store shows
  (`hook_ranks_held`). A hook still writing then makes the client wait, and after `wait_s` refuse, naming it.
- Every sample is committed exactly once over all ranks: the client routes each sample to one DP group
  (client.dp_group), whose hook refuses a second copy; `finalize_store` refuses a store where a sample id is in
  two shards anyway, naming them (the reader would refuse it later, with no way to tell which writer did it).
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


def duplicate_samples(store) -> dict[str, list[str]]:
    """Sample ids committed in more than one shard of `store` -> those shard files, in name order."""
    from eyas.store.writer import read_sidecars  # noqa: PLC0415
    where: dict[str, list[str]] = {}
    for r in read_sidecars(Path(store)):
        for i in r["ids"]:
            where.setdefault(i, []).append(r["file"])
    return {i: f for i, f in where.items() if len(f) > 1}


def finalize_store(store, header: dict, expected_ids, *, wait_s: float) -> dict:
    """Mark STORE complete if it holds exactly `expected_ids`, with no hook writing meanwhile (a hook's shard
    committed during finalize would rewrite the manifest as incomplete). A sample committed twice (two ranks
    wrote it) leaves the store incomplete and raises, naming the sample and its shards."""
    from eyas.store.writer import StoreWriter  # noqa: PLC0415
    with hook_ranks_held(store, wait_s):
        w = StoreWriter(store, header=header, setup=False)
        w.close()
        m = w.finalize(set(expected_ids))
        dup = duplicate_samples(store)
    if dup:
        sid = min(dup)
        raise EyasError(f"{store}: sample {sid!r} is committed twice, in {' and '.join(dup[sid])} ({len(dup)} "
                        f"sample(s) so): two ranks wrote it; delete one of those shards and its .json record, then "
                        f"rerun the same capture command (the shard's other samples are sent again)")
    return m
