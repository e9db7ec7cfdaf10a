"""The prepared-data directory: tokenized training conversations with loss masks.

    DIR/samples.jsonl   one line per kept training conversation:
                        {"id": str, "input_ids": [int, ...], "trainable": [[start, end], ...]}
                        `trainable` lists the half-open token ranges whose loss_mask is 1.
    DIR/skipped.jsonl   one line per skipped record or dropped sample: {"reason", "where", "detail"}
                        (the run prints one summary line with the counts per reason).
    DIR/progress.json   while writing: the committed byte lengths of samples.jsonl and skipped.jsonl,
                        how many source records were consumed, the counts so far, and the config/target.
    DIR/manifest.json   written last (kind "prepared"): schema, version, target fingerprint, counts,
                        resolved config, size and sha256 of samples.jsonl.

Both JSON files carry VERSION; a directory of another version is refused in one line (prepare it again).

Crash safety: samples (and skip details) are appended, then flushed and fsynced, then progress.json
is replaced atomically. A rerun truncates both files back to their committed lengths and continues
from the committed source position, so a kill at any point loses and duplicates nothing.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eyas.errors import EyasError
from eyas.manifest import MANIFEST, atomic_write_bytes, check_same, fsync_dir, read_manifest, sha256_file, write_manifest

SAMPLES = "samples.jsonl"
SKIPS = "skipped.jsonl"
PROGRESS = "progress.json"
KIND = "prepared"
VERSION = 2
"""The layout of manifest.json and progress.json (the resolved config's shape: PrepareConfig with its nested
`regen`, and the counts)."""


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # loss_mask[i] == 1: token i is trainable (assistant text / end-of-turn)


def mask_to_spans(mask: list[int]) -> list[list[int]]:
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    if start is not None:
        spans.append([start, len(mask)])
    return spans


def spans_to_mask(spans: list[list[int]], n: int) -> list[int]:
    mask = [0] * n
    for s, e in spans:
        mask[s:e] = [1] * (e - s)
    return mask


def encode_sample(s: Sample) -> bytes:
    rec = {"id": s.id, "input_ids": s.input_ids, "trainable": mask_to_spans(s.loss_mask)}
    return (json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")


def decode_sample(line: bytes, where: str) -> Sample:
    try:
        rec = json.loads(line)
        ids = rec["input_ids"]
        return Sample(rec["id"], ids, spans_to_mask(rec["trainable"], len(ids)))
    except (ValueError, KeyError, TypeError) as e:
        raise EyasError(f"{where}: corrupt sample ({e})") from e


def check_version(record: dict, path: Path) -> None:
    """Refuse a manifest.json or progress.json of another VERSION (none recorded: version 1)."""
    v = record.get("version", 1)
    if v != VERSION:
        raise EyasError(f"{path}: prepared-data version {v}, this eyas reads version {VERSION}; prepare the data "
                        f"again (eyas prepare --overwrite, or eyas run --overwrite)")


# --------------------------------------------------------------------------- writer

class PreparedWriter:
    """Append-only writer with commit points; reopening an interrupted directory resumes it.

    `identity` is what must match to resume (resolved config that changes the data + target
    fingerprint). After construction: `complete` (a finished manifest with the same identity
    exists), `consumed` (source records already processed) and `state` (counts) tell the caller
    where to continue.
    """

    def __init__(self, out_dir: str | os.PathLike, *, identity: dict, overwrite: bool = False):
        self.dir = Path(out_dir)
        self.identity = identity
        self.consumed, self.state, self.complete, self.manifest = 0, None, False, None
        if self.dir.exists() and not self.dir.is_dir():
            raise EyasError(f"{self.dir}: exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        samples, progress, manifest = self.dir / SAMPLES, self.dir / PROGRESS, self.dir / MANIFEST
        if overwrite:
            for p in (manifest, progress, samples, self.dir / SKIPS):
                p.unlink(missing_ok=True)
        if manifest.exists():
            m = read_manifest(self.dir, kind=KIND)
            check_version(m, manifest)
            self._check_identity(m.get("identity", {}), "an existing prepared directory")
            self.complete, self.manifest = True, m
            return
        committed = committed_log = 0
        if progress.exists():
            try:
                p = json.loads(progress.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise EyasError(f"{progress}: unreadable ({e}); rerun with --overwrite") from e
            check_version(p, progress)
            self._check_identity(p["identity"], "an interrupted prepare run")
            committed, committed_log, self.consumed, self.state = p["bytes"], p["log_bytes"], p["consumed"], p["state"]
        # no progress file: killed before the first commit, nothing in samples.jsonl counts
        self._f = self._reopen(samples, committed)
        self._log = self._reopen(self.dir / SKIPS, committed_log)
        self._bytes, self._log_bytes = committed, committed_log
        self._synced = {self._f.name: committed, self._log.name: committed_log}

    @staticmethod
    def _reopen(path: Path, committed: int):
        f = open(path, "ab")
        if f.tell() < committed:
            f.close()
            raise EyasError(f"{path}: shorter than its committed length {committed}; rerun with --overwrite")
        f.truncate(committed)
        f.seek(committed)
        return f

    def _check_identity(self, old: dict, what: str) -> None:
        check_same(old, self.identity, what=f"config/target of {what}",
                   where=f"{self.dir} (use --overwrite to start again)")

    def add(self, sample: Sample) -> None:
        assert len(sample.input_ids) == len(sample.loss_mask)
        line = encode_sample(sample)
        self._f.write(line)
        self._bytes += len(line)

    def log(self, reason: str, where: str, detail: str) -> None:
        """Record why a source record was skipped or a sample dropped (committed with the samples)."""
        line = (json.dumps({"reason": reason, "where": where, "detail": detail}, ensure_ascii=False) + "\n"
                ).encode("utf-8", "surrogatepass")
        self._log.write(line)
        self._log_bytes += len(line)

    def commit(self, consumed: int, state: dict) -> None:
        """Make everything added so far durable, then record the resume point."""
        for f, n in ((self._f, self._bytes), (self._log, self._log_bytes)):
            if n != self._synced.get(f.name):  # nothing new: no fsync
                f.flush()
                os.fsync(f.fileno())
                self._synced[f.name] = n
        self.consumed, self.state = consumed, state
        rec = {"version": VERSION, "identity": self.identity, "bytes": self._bytes, "log_bytes": self._log_bytes,
               "consumed": consumed, "state": state}
        atomic_write_bytes(self.dir / PROGRESS, json.dumps(rec).encode())

    def finish(self, manifest: dict) -> dict:
        self.close()
        files = {name: {"bytes": (self.dir / name).stat().st_size, "sha256": sha256_file(self.dir / name)}
                 for name in (SAMPLES, SKIPS)}
        manifest = {"kind": KIND, "version": VERSION, **manifest, "identity": self.identity, "files": files}
        write_manifest(self.dir, manifest)
        (self.dir / PROGRESS).unlink(missing_ok=True)
        fsync_dir(self.dir)
        self.manifest = read_manifest(self.dir, kind=KIND)
        return self.manifest

    def close(self) -> None:
        for f in (self._f, self._log):
            if not f.closed:
                f.close()


# --------------------------------------------------------------------------- reader

class PreparedData:
    """Random access to a finished prepared directory. With `target`, refuses another target's data."""

    def __init__(self, path: str | os.PathLike, *, target=None):
        self.path = Path(path)
        if (self.path / PROGRESS).exists() and not (self.path / MANIFEST).exists():
            raise EyasError(f"{self.path}: prepare did not finish (rerun the same prepare command to resume)")
        self.manifest = read_manifest(self.path, kind=KIND)
        check_version(self.manifest, self.path / MANIFEST)
        if target is not None:
            check_same(self.manifest["target"], target.fingerprint, what="target", where=str(self.path))
        self._file = self.path / SAMPLES
        want = self.manifest["files"][SAMPLES]["bytes"]
        if not self._file.exists() or self._file.stat().st_size != want:
            raise EyasError(f"{self._file}: missing or not {want} bytes as the manifest says (rerun prepare)")
        self._offsets = array("q", [0])
        with open(self._file, "rb") as f:
            for line in f:
                self._offsets.append(self._offsets[-1] + len(line))
        if len(self) != self.manifest["counts"]["kept"]:
            raise EyasError(f"{self._file}: {len(self)} samples, manifest says {self.manifest['counts']['kept']}")
        self._fd, self._pid = None, None

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _read(self, i: int) -> bytes:
        if self._fd is None or self._pid != os.getpid():  # one fd per process (DataLoader workers fork)
            self._fd, self._pid = os.open(self._file, os.O_RDONLY), os.getpid()
        a, b = self._offsets[i], self._offsets[i + 1]
        return os.pread(self._fd, b - a, a)

    def __getitem__(self, i: int) -> Sample:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range ({n} samples)")
        return decode_sample(self._read(i), f"{self._file} sample {i}")

    def __iter__(self) -> Iterator[Sample]:
        with open(self._file, "rb") as f:
            for i, line in enumerate(f):
                yield decode_sample(line, f"{self._file} sample {i}")

    def __del__(self):
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass


def load_prepared_samples(data: str):
    """(manifest, {id: input_ids}, {id: loss_mask}) of the prepared directory DATA: what an engine capture sends."""
    pd = PreparedData(data)
    ids = {s.id: s.input_ids for s in pd}
    masks = {s.id: s.loss_mask for s in pd}
    return pd.manifest, ids, masks
