"""StoreWriter: crash-safe, resumable, multi-rank writing of hidden-state shards.

Commit protocol for one shard (see docs/store.md):
  1. write `.shard-rRRR-IIIII.safetensors.tmp`, fsync it;
  2. rename it to `shard-rRRR-IIIII.safetensors`, fsync the directory;
  3. atomically write the sidecar `shard-rRRR-IIIII.json` (sample ids, counts, sha256): the commit;
  4. rewrite manifest.json (header + all sidecars gathered from the directory).
A shard without its sidecar is not committed; on restart its rank deletes it and the temp files.
One writer per rank: run_capture holds STORE/.lock-rRRR while it writes (store/lock.py).

Behind add() (overlap=True, the default) three stages run at once, each hand-off bounded, so the caller waits
only when the disk is behind:
  caller   on CUDA, queues the batch's copy into one of STAGING pinned host buffers (reused round-robin) on a
           side stream, after an event on the producing stream, and returns;
  intake   a thread: waits for that copy and packs the rows into the shard being filled, a reusable host buffer
           laid out as the finished file (a pool of threads + 1); hands a full shard to a writer;
  writers  `threads` threads: header, sha256, write + fsync, rename, commit record, manifest.
overlap=False does the same in the caller's thread through safetensors.save: the reference the tests compare
the pipeline with, file for file, and the synchronous rate of benchmarks.capture.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from eyas.errors import EyasError
from eyas.manifest import MANIFEST, atomic_write_bytes, check_same, fsync_dir, read_manifest, write_manifest
from eyas.store import format as fmt
from eyas.store.lock import LOCK_RE
from eyas.store.shardfile import STAGING, Shard, Staging, canonical, shard_tensors, st_order

_STOP = object()


def _write_file(path: Path, data: bytes | memoryview) -> None:
    """Write + fsync one file (a separate function so tests can simulate a full disk)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_RECORD_FIELDS = {"file": str, "rank": int, "samples": int, "tokens": int, "loss_tokens": int, "bytes": int,
                  "sha256": str, "ids": list}


def _check_record(rec, p: Path) -> dict:
    """A sidecar must describe its own shard (no other file, no path outside the store) with typed fields."""
    if not isinstance(rec, dict):
        raise EyasError(f"{p}: shard record is not a JSON object")
    for k, t in _RECORD_FIELDS.items():
        v = rec.get(k)
        if not isinstance(v, t) or (t is int and (isinstance(v, bool) or v < 0)):
            raise EyasError(f"{p}: shard record field {k!r} is {v!r}, expected a {t.__name__}")
    shard = p.name[: -len(".json")] + ".safetensors"
    if rec["file"] != shard:
        raise EyasError(f"{p}: shard record names {rec['file']!r}, expected its own shard {shard!r}")
    if rec["rank"] != int(fmt.SIDECAR_RE.match(p.name).group(1)):
        raise EyasError(f"{p}: shard record says rank {rec['rank']}, its name says otherwise")
    if len(rec["ids"]) != rec["samples"] or not all(isinstance(i, str) for i in rec["ids"]):
        raise EyasError(f"{p}: shard record lists {len(rec['ids'])} ids for {rec['samples']} samples "
                        f"(ids must be strings)")
    return rec


def read_sidecars(path: Path) -> list[dict]:
    """All committed shard records of a store, sorted by shard name."""
    out = []
    for p in sorted(path.glob("shard-r*-*.json")):
        if not fmt.SIDECAR_RE.match(p.name):
            continue
        try:
            rec = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EyasError(f"{p}: unreadable shard record ({e})") from e
        out.append(_check_record(rec, p))
    return out


def prepare_store_dir(path: Path, header: dict, *, overwrite: bool, clear: bool) -> None:
    """Create STORE or check that an existing one has the same configuration; `clear` may delete it."""
    if path.exists() and not path.is_dir():
        raise EyasError(f"{path}: exists and is not a directory")
    if path.is_dir() and (clear or not (path / MANIFEST).exists()):
        # a writer killed while writing a manifest leaves its temp file (the first time, with only its lock):
        # rank 0 removes them before the other ranks start writing
        for p in path.iterdir():
            if p.name.startswith(f".{MANIFEST}.tmp-"):
                p.unlink(missing_ok=True)
    if path.is_dir() and any(not LOCK_RE.match(p.name) for p in path.iterdir()):  # a writer lock is not content
        if not (path / MANIFEST).exists():
            raise EyasError(f"{path}: not empty and not an eyas store; refusing to write into it")
        old = read_manifest(path)
        if old.get("kind") != fmt.KIND:
            raise EyasError(f"{path}: holds a {old.get('kind')!r} directory, not a store; refusing to write into it")
        if fmt.identity(old) != fmt.identity(header) and not overwrite:
            try:
                check_same(fmt.identity(old), fmt.identity(header), what="existing store configuration",
                           where=str(path))
            except EyasError as e:
                raise EyasError(f"{e}; pass --overwrite to replace it") from None
        if overwrite and clear:
            for p in path.iterdir():
                if p.name == MANIFEST or fmt.SHARD_RE.match(p.name) or fmt.SIDECAR_RE.match(p.name) \
                        or p.name.startswith((".shard-r", f".{MANIFEST}")):
                    p.unlink()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EyasError(f"{path}: cannot create the store directory ({e.strerror or e})") from e
    if not os.access(path, os.W_OK):
        raise EyasError(f"{path}: directory is not writable")


class StoreWriter:
    """Writes samples into STORE as this rank's shards, in background threads (overlap=True; module docstring).

    header: {"target": fingerprint, "layers": {"aux": [...], "convention": ...}, "dtype": "bf16"|"fp8",
             "hidden_size": h, "vocab_size": V, "data": {...}, "config": {...}}
    """

    def __init__(self, path, *, header: dict, rank: int = 0, world_size: int = 1, overwrite: bool = False,
                 shard_bytes: int = 512 << 20, threads: int = 2, setup: bool = True, overlap: bool = True):
        if header.get("dtype") not in fmt.DTYPES:
            raise EyasError(f"store dtype {header.get('dtype')!r}: expected one of {sorted(fmt.DTYPES)}")
        self.path = Path(path)
        self.header = {"kind": fmt.KIND, "format": fmt.FORMAT, **header}
        self.header["layers"] = {**header["layers"], "convention": fmt.LAYER_CONVENTION}
        self.rank, self.world_size = rank, world_size
        self.shard_bytes = shard_bytes
        self.dtype = header["dtype"]
        self.overlap = overlap
        if setup:
            prepare_store_dir(self.path, self.header, overwrite=overwrite, clear=(rank == 0))
        self._clean_orphans()
        self._records = read_sidecars(self.path)
        self.committed_ids: set[str] = {i for r in self._records for i in r["ids"]}
        mine = [int(fmt.SHARD_RE.match(r["file"]).group(2)) for r in self._records if r["rank"] == rank]
        self._next_index = max(mine, default=-1) + 1
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.bytes_written = 0
        self.tokens_written = 0
        dtypes = {"input_ids": torch.int32, "loss_mask": torch.uint8, "offsets": torch.int64,
                  "hidden": fmt.DTYPES[self.dtype], **({"scale": torch.float32} if self.dtype == "fp8" else {})}
        self._order = st_order(tuple(dtypes.items()))
        self._pending: list[tuple] = []   # overlap=False: the batches of the shard being gathered
        self._pending_bytes = 0
        self._write_manifest(complete=False)
        self._copy_stream, self._staging, self._turn = None, [], 0
        self._threads: list[threading.Thread] = []
        if overlap:
            self._intake: queue.Queue = queue.Queue(maxsize=STAGING)
            self._out: queue.Queue = queue.Queue(maxsize=threads)
            self._free: queue.Queue = queue.Queue()   # shard buffers back from the writers
            self._unmade = threads + 1                # one being packed, one per writer
            self._threads = [threading.Thread(target=self._intake_loop, daemon=True, name="store-intake")]
            self._threads += [threading.Thread(target=self._write_loop, daemon=True, name=f"store-write{i}")
                              for i in range(threads)]
            for t in self._threads:
                t.start()

    # ---- producer side (the caller's thread) ----
    def add(self, ids: list[str], lengths: list[int], input_ids: torch.Tensor, loss_mask: torch.Tensor,
            hidden: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Queue a packed batch: tokens of the samples concatenated in order.

        input_ids/loss_mask (N,), hidden (N, 4, h) in the store dtype, scale (N, 4) float32 for fp8.
        Tensors may live on a GPU: the copy to the host runs on a side stream while the caller goes on.
        """
        self._raise_if_failed()
        assert sum(lengths) == hidden.shape[0] == input_ids.shape[0] == loss_mask.shape[0]
        assert hidden.dtype == fmt.DTYPES[self.dtype] and (scale is None) == (self.dtype == "bf16")
        if not self.overlap:
            self._pending.append((list(ids), list(lengths), input_ids.cpu(), loss_mask.cpu(), hidden.cpu(),
                                  None if scale is None else scale.cpu()))
            self._pending_bytes += hidden.numel() * hidden.element_size()
            if self._pending_bytes >= self.shard_bytes:
                self._write_pending()
            return
        done = slot = None
        if hidden.is_cuda:
            input_ids, loss_mask, hidden, scale, done, slot = self._copy_to_host(input_ids, loss_mask, hidden, scale)
        self._put(self._intake, (list(ids), list(lengths), input_ids, loss_mask, hidden, scale, done, slot))

    def _copy_to_host(self, input_ids, loss_mask, hidden, scale):
        """Start the batch's device->host copy into the next pinned staging buffer, on the side stream."""
        dev = hidden.device
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=dev)
            self._staging = [Staging() for _ in range(STAGING)]
        slot = self._staging[self._turn % STAGING]
        self._turn += 1
        while not slot.free.wait(0.5):  # the intake still packs what this buffer held STAGING batches ago
            self._raise_if_failed()
        slot.free.clear()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))     # the batch's states are computed up to here
        with torch.inference_mode(), torch.cuda.stream(self._copy_stream):   # inference mode: as in a forward hook
            h = slot.view("hidden", hidden)
            s = None if scale is None else slot.view("scale", scale)
            self._copy_stream.wait_event(ready)
            h.copy_(hidden, non_blocking=True)
            if s is not None:
                s.copy_(scale, non_blocking=True)
            ids_h, mask_h = (t.to("cpu", non_blocking=True) if t.is_cuda else t for t in (input_ids, loss_mask))
            done = torch.cuda.Event(blocking=True)   # the intake sleeps on it rather than spin
            done.record(self._copy_stream)
        for t in (hidden, scale, input_ids, loss_mask):
            if t is not None and t.is_cuda:
                t.record_stream(self._copy_stream)   # the allocator keeps it until the copy has run
        return ids_h, mask_h, h, s, done, slot

    def add_sample(self, id: str, input_ids, loss_mask, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Convenience: one sample, aux (T, 3, h) and final (T, h) in any float dtype."""
        hidden = torch.cat([aux, final.unsqueeze(1)], dim=1)  # (T, 4, h)
        q, scale = fmt.quantize(hidden, self.dtype)
        ids = torch.as_tensor(input_ids, dtype=torch.int32)
        self.add([id], [ids.shape[0]], ids, torch.as_tensor(loss_mask, dtype=torch.uint8), q, scale)

    def close(self) -> None:
        """Write the last partial shard, wait for all writes, raise the first error (an EyasError)."""
        if not self.overlap:
            if self._pending:
                self._write_pending()
            return
        if self._threads[0].is_alive():
            self._put(self._intake, _STOP)
        for t in self._threads:
            t.join()
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop the threads after an error elsewhere; committed shards stay, temp files are removed."""
        self._fail(EyasError("aborted"))
        self._pending, self._pending_bytes = [], 0
        while self._threads and self._threads[0].is_alive():  # the intake drains what is queued, then stops
            try:
                self._intake.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                continue
        for t in self._threads:
            t.join(timeout=60)

    def finalize(self, expected_ids: set[str] | None) -> dict:
        """Mark the store complete if it holds exactly `expected_ids` (any rank may call it)."""
        self._records = read_sidecars(self.path)
        have = [i for r in self._records for i in r["ids"]]
        complete = expected_ids is None or (len(have) == len(set(have)) and set(have) == set(expected_ids))
        return self._write_manifest(complete=complete)

    # ---- threads ----
    def _put(self, q: queue.Queue, item) -> None:
        while True:
            try:
                q.put(item, timeout=0.5)
                return
            except queue.Full:
                self._raise_if_failed()

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            if isinstance(self._error, EyasError):
                raise self._error
            raise EyasError(f"{self.path}: shard writer failed ({self._error!r})") from self._error

    def _intake_loop(self) -> None:
        shard = None
        while True:
            item = self._intake.get()
            if item is _STOP:
                if shard is not None and shard.ids and self._error is None:
                    self._hand_over(shard)
                for _ in range(len(self._threads) - 1):
                    self._out.put(_STOP)
                return
            *batch, done, slot = item
            try:
                if self._error is None:
                    if done is not None:
                        done.synchronize()      # the side stream's copy into the staging buffer
                    shard = shard or self._take_shard()
                    if shard is not None:
                        shard.add(*batch, shard_bytes=self.shard_bytes)
                        if shard.nbytes >= self.shard_bytes:
                            self._hand_over(shard)
                            shard = None
            except BaseException as e:  # noqa: BLE001 - reported to the producer
                self._fail(e)
            finally:
                if slot is not None:
                    slot.free.set()

    def _take_shard(self) -> Shard | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._unmade:
            self._unmade -= 1
            return Shard()
        while self._error is None:   # every buffer is being written: the disk is behind, and so back-pressure
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                continue
        return None

    def _hand_over(self, shard: Shard) -> None:
        name = fmt.shard_name(self.rank, self._next_index)
        self._next_index += 1
        while self._error is None:
            try:
                self._out.put((name, shard), timeout=0.5)
                return
            except queue.Full:
                continue

    def _write_loop(self) -> None:
        while True:
            item = self._out.get()
            if item is _STOP:
                return
            name, shard = item
            try:
                if self._error is None:
                    tensors = shard_tensors(shard.lengths, shard.input_ids, shard.loss_mask, shard.scale)
                    data = shard.finish(self._order, tensors, self._metadata(shard.ids))
                    self._commit(name, data, shard.ids, tensors)
            except BaseException as e:  # noqa: BLE001 - reported to the producer
                self._fail(e)
            finally:
                shard.reset()
                self._free.put(shard)

    # ---- writing one shard ----
    def _metadata(self, ids: list[str]) -> dict[str, str]:
        return {"format": fmt.FORMAT, "ids": json.dumps(ids)}

    def _write_pending(self) -> None:
        """overlap=False: the batches gathered so far as one shard, through safetensors.save, in this thread."""
        name = fmt.shard_name(self.rank, self._next_index)
        self._next_index += 1
        batches, self._pending, self._pending_bytes = self._pending, [], 0
        ids = [i for b in batches for i in b[0]]
        tensors = shard_tensors([n for b in batches for n in b[1]], [b[2] for b in batches], [b[3] for b in batches],
                                [b[5] for b in batches if b[5] is not None])
        data = canonical(st_save({**tensors, "hidden": torch.cat([b[4] for b in batches])},
                                 metadata=self._metadata(ids)))
        self._commit(name, data, ids, tensors)

    def _commit(self, name: str, data, ids: list[str], tensors: dict[str, torch.Tensor]) -> None:
        """Write the file bytes `data` as shard `name` and commit it (module docstring, steps 1-4)."""
        sha = hashlib.sha256(data).hexdigest()
        final = self.path / name
        tmp = self.path / f".{name}.tmp"
        try:
            _write_file(tmp, data)
            os.replace(tmp, final)
            fsync_dir(self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            final.unlink(missing_ok=True)
            with self._lock:
                n = sum(r["samples"] for r in self._records)
            what = "disk full" if e.errno == errno.ENOSPC else "cannot write"
            raise EyasError(f"{final}: {what} while writing a shard ({e.strerror or e}); the store keeps its "
                            f"{n} committed samples, free space / fix the directory and rerun to resume") from e
        rec = {"file": name, "rank": self.rank, "samples": len(ids), "tokens": int(tensors["offsets"][-1]),
               "loss_tokens": int(tensors["loss_mask"].sum()), "bytes": len(data), "sha256": sha, "ids": ids}
        atomic_write_bytes(self.path / fmt.sidecar_name(name), (json.dumps(rec) + "\n").encode())
        with self._lock:
            self._records.append(rec)
            self.committed_ids.update(ids)
            self.bytes_written += len(data)
            self.tokens_written += rec["tokens"]
            self._write_manifest(complete=False)

    # ---- manifest ----
    def _clean_orphans(self) -> None:
        """Delete temp files and uncommitted shards of the ranks this rank replaces."""
        for p in list(self.path.iterdir()):
            m = fmt.SHARD_RE.match(p.name)
            if p.name.startswith(".shard-r"):
                r = int(p.name[len(".shard-r"):][:3])
            elif m and not (self.path / fmt.sidecar_name(p.name)).exists():
                r = int(m.group(1))
            else:
                continue
            if r % self.world_size == self.rank:
                p.unlink(missing_ok=True)

    def _write_manifest(self, *, complete: bool) -> dict:
        if self.world_size > 1:
            records = read_sidecars(self.path)
        else:
            records = sorted(self._records, key=lambda r: r["file"])
        shards = [{k: v for k, v in r.items() if k != "ids"} for r in records]
        m = {**self.header, "complete": bool(complete),
             "num_shards": len(shards),
             "num_samples": sum(s["samples"] for s in shards),
             "num_tokens": sum(s["tokens"] for s in shards),
             "num_loss_tokens": sum(s["loss_tokens"] for s in shards),
             "bytes": sum(s["bytes"] for s in shards),
             "shards": shards}
        write_manifest(self.path, m)
        return {"schema": 1, **m}

