"""Reading a hidden-state store: memory-mapped random access by sample, and a resumable training stream."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from eyas.errors import EyasError
from eyas.manifest import check_same, read_manifest
from eyas.store import format as fmt
from eyas.store.verify import verify_store
from eyas.store.writer import read_sidecars
from eyas.target.fingerprint import file_sha256


@dataclass(frozen=True)
class StoredSample:
    id: str
    input_ids: torch.Tensor   # (T,) int64
    loss_mask: torch.Tensor   # (T,) bool, True = trainable token
    aux: torch.Tensor         # (T, 3, h) low/mid/high residual streams, HF hidden_states[aux_layer_ids]
    final: torch.Tensor       # (T, h) final-norm output; target logits = lm_head(final)


def _check_header(m: dict, path: Path) -> None:
    """The manifest fields the reader relies on, with a message instead of a KeyError later."""
    def bad(what: str):
        raise EyasError(f"{path / 'manifest.json'}: {what}")

    if m.get("dtype") not in fmt.DTYPES:
        bad(f"dtype {m.get('dtype')!r}, expected one of {sorted(fmt.DTYPES)}")
    h = m.get("hidden_size")
    if not isinstance(h, int) or isinstance(h, bool) or h <= 0:
        bad(f"hidden_size {h!r}, expected a positive integer")
    aux = m["layers"].get("aux")
    if not (isinstance(aux, list) and len(aux) == 3 and all(isinstance(i, int) for i in aux)):
        bad(f"layers.aux {aux!r}, expected three layer ids")
    if not isinstance(m.get("target"), dict):
        bad(f"target {m.get('target')!r}, expected a fingerprint object")
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("file"), str) for s in shards):
        bad("'shards' is not a list of shard entries")


class Store:
    """A store directory. `target` (a Target or a fingerprint dict) makes it refuse another target's store."""

    def __init__(self, path, *, target=None, dtype: torch.dtype = torch.bfloat16, allow_incomplete: bool = False):
        self.path = Path(path)
        self.manifest = read_manifest(self.path, kind=fmt.KIND)
        m = self.manifest
        if m.get("format") != fmt.FORMAT:
            raise EyasError(f"{self.path}: store format {m.get('format')!r}, this eyas reads {fmt.FORMAT!r}")
        layers = m.get("layers")
        if not isinstance(layers, dict) or layers.get("convention") != fmt.LAYER_CONVENTION:
            raise EyasError(f"{self.path}: layer convention {layers!r}, expected {fmt.LAYER_CONVENTION!r}")
        _check_header(m, self.path)
        if target is not None:
            fp = target if isinstance(target, dict) else target.fingerprint
            check_same(fp, m["target"], what="target", where=str(self.path))
        if not m.get("complete") and not allow_incomplete:
            raise EyasError(f"{self.path}: store is incomplete (capture was interrupted?); rerun the same "
                            f"capture command to resume it")
        self.dtype = dtype
        self.records = read_sidecars(self.path)
        if m.get("complete"):
            listed = sorted(s["file"] for s in m["shards"])
            if listed != [r["file"] for r in self.records]:
                raise EyasError(f"{self.path}: manifest lists {len(listed)} shards but the directory has "
                                f"{len(self.records)} committed shards; rerun capture to repair")
        for r in self.records:
            f = self.path / r["file"]
            if not f.exists() or f.stat().st_size != r["bytes"]:
                raise EyasError(f"{f}: missing or wrong size (expected {r['bytes']} bytes); run `eyas store verify`")
        self.ids: list[str] = [i for r in self.records for i in r["ids"]]
        self._starts = [0]
        for r in self.records:
            self._starts.append(self._starts[-1] + r["samples"])
        self._index = {i: n for n, i in enumerate(self.ids)}
        if len(self._index) != len(self.ids):
            raise EyasError(f"{self.path}: a sample id appears in more than one shard; run `eyas store verify`")
        self._handles: dict = {}
        self._offsets: dict = {}
        self._stat: dict = {}
        self._pid = os.getpid()

    # ---- header ----
    @property
    def aux_layer_ids(self) -> tuple[int, int, int]:
        return tuple(self.manifest["layers"]["aux"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def store_dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def fingerprint(self) -> dict:
        return self.manifest["target"]

    @property
    def num_tokens(self) -> int:
        return sum(r["tokens"] for r in self.records)

    def __len__(self) -> int:
        return len(self.ids)

    # ---- random access ----
    def _shard(self, k: int):
        """The open shard k. Its bytes are checked against the sha256 of its record when first opened (the hash
        is kept per machine in $EYAS_CACHE/hashes while the file's size, mtime and inode stay: every rank and run
        after the first skips it; `eyas store verify` always rehashes), and its size, mtime and inode before every
        read: a shard rewritten or truncated under a running reader stops it with an error naming the shard, never
        a silent bad sample or a SIGBUS (an in-place bit flip that keeps all three is `eyas store verify`'s to find)."""
        if self._pid != os.getpid():  # forked DataLoader worker: reopen the maps
            self._handles, self._offsets, self._stat, self._pid = {}, {}, {}, os.getpid()
        rec = self.records[k]
        f = self.path / rec["file"]
        try:
            st = os.stat(f)
        except OSError as e:
            raise EyasError(f"{f}: shard vanished while reading the store ({e.strerror or e})") from e
        now = (st.st_size, st.st_mtime_ns, st.st_ino)
        h = self._handles.get(k)
        if h is None:
            if st.st_size != rec["bytes"]:
                raise EyasError(f"{f}: shard is {st.st_size} bytes, its record says {rec['bytes']}: it is corrupted; "
                                f"run `eyas store verify`")
            if file_sha256(f) != rec["sha256"]:
                raise EyasError(f"{f}: sha256 mismatch with its record: the shard is corrupted; "
                                f"run `eyas store verify`")
            try:
                h = safe_open(str(f), framework="pt")
                off = h.get_tensor("offsets").tolist()
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types
                raise EyasError(f"{f}: not a readable shard ({' '.join(str(e).split())})") from e
            if len(off) != rec["samples"] + 1:
                raise EyasError(f"{f}: {len(off) - 1} samples, its record says {rec['samples']}")
            self._handles[k], self._offsets[k], self._stat[k] = h, off, now
        elif now != self._stat[k]:
            raise EyasError(f"{f}: shard changed on disk while training read it (size {self._stat[k][0]} -> "
                            f"{st.st_size}, or rewritten); it may be corrupted; run `eyas store verify`")
        return h, self._offsets[k]

    def check_shards(self, rank: int = 0, world: int = 1) -> None:
        """Open (and so hash, where this machine has not) every world-th shard from `rank`: ranks that split the
        store this way before training, then meet at a barrier, leave no shard for the training loop to hash."""
        for k in range(rank, len(self.records), world):
            self._shard(k)

    def __getitem__(self, i: int) -> StoredSample:
        return self.get(i)

    def get(self, i: int, dtype: torch.dtype | None = None) -> StoredSample:
        ids, mask, hidden, scale = self.get_stored(i)
        hidden = fmt.dequantize(hidden, scale, dtype or self.dtype)
        return StoredSample(
            id=self.ids[i % len(self)],
            input_ids=ids.long(),
            loss_mask=mask.bool(),
            aux=hidden[:, :3],                                          # (T, 3, h)
            final=hidden[:, 3],                                         # (T, h)
        )

    def get_stored(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sample i as stored: (input_ids, loss_mask, hidden (T, 4, h) in the store's dtype, fp8 scales (T, 4) or
        None), views of the mapped shard; get() dequantizes these."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)}")
        i %= len(self)
        k = bisect.bisect_right(self._starts, i) - 1
        j = i - self._starts[k]
        h, off = self._shard(k)
        a, b = off[j], off[j + 1]
        try:
            hidden = h.get_slice("hidden")[a:b]                       # (T, 4, h) stored dtype
            scale = h.get_slice("scale")[a:b] if self.store_dtype == "fp8" else None
            input_ids, loss_mask = h.get_slice("input_ids")[a:b], h.get_slice("loss_mask")[a:b]
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types
            raise EyasError(f"{self.path / self.records[k]['file']}: cannot read sample {self.ids[i]!r} "
                            f"({' '.join(str(e).split())}); run `eyas store verify`") from e
        return input_ids, loss_mask, hidden, scale

    def index_of(self, sample_id: str) -> int:
        try:
            return self._index[sample_id]
        except KeyError:
            raise EyasError(f"{self.path}: no sample with id {sample_id!r}") from None

    def by_id(self, sample_id: str, dtype: torch.dtype | None = None) -> StoredSample:
        return self.get(self.index_of(sample_id), dtype)

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}, "_offsets": {}, "_stat": {}}

    # ---- reports ----
    def info(self) -> dict:
        m = self.manifest
        tokens = self.num_tokens
        nbytes = sum(r["bytes"] for r in self.records)
        return {"path": str(self.path), "complete": bool(m.get("complete")), "samples": len(self),
                "tokens": tokens, "loss_tokens": sum(r["loss_tokens"] for r in self.records),
                "shards": len(self.records), "bytes": nbytes,
                "bytes_per_token": round(nbytes / tokens, 2) if tokens else None,
                "dtype": m["dtype"], "hidden_size": m["hidden_size"], "aux_layer_ids": list(self.aux_layer_ids),
                "layer_convention": m["layers"]["convention"], "target": m["target"].get("identity"),
                "ranks": sorted({r["rank"] for r in self.records})}

    def verify(self, progress: bool = False) -> dict:
        return verify_store(self, progress=progress)

    # ---- training stream ----
    def stream(self, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
               dtype: torch.dtype | None = None) -> "SampleStream":
        return SampleStream(self, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, dtype=dtype)


class SampleStream:
    """Endless epoch-by-epoch iterator over a store for one rank; resumable via state_dict().

    Epoch e visits a permutation of all samples drawn from seed+e (or store order if not shuffle); rank r
    takes positions r, r+W, ... of it, truncated so every rank yields len(store)//W samples per epoch.
    """

    def __init__(self, store: Store, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 dtype: torch.dtype | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        if len(store) < world_size:
            raise EyasError(f"{store.path}: {len(store)} samples cannot be split over {world_size} ranks")
        self.store, self.shuffle, self.seed = store, shuffle, seed
        self.rank, self.world_size, self.dtype = rank, world_size, dtype
        self.epoch, self.position = 0, 0
        self.per_rank = len(store) // world_size

    def order(self, epoch: int) -> list[int]:
        """The sample indices this rank visits in `epoch`."""
        n = len(self.store)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(n, generator=g).tolist()
        else:
            perm = list(range(n))
        return perm[self.rank::self.world_size][: self.per_rank]

    def __iter__(self) -> Iterator[StoredSample]:
        while True:
            order = self.order(self.epoch)
            while self.position < len(order):
                i = order[self.position]
                self.position += 1
                yield self.store.get(i, self.dtype)
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """Position after the last yielded sample: a restored stream continues with the next one."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "rank": self.rank, "world_size": self.world_size, "num_samples": len(self.store)}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "shuffle", "world_size", "num_samples"):
            mine = self.state_dict()[k]
            if state[k] != mine:
                raise EyasError(f"{self.store.path}: stream state has {k}={state[k]!r}, this stream {mine!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def collate(samples: list[StoredSample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples into a batch; attention_mask marks real tokens."""
    B, T = len(samples), max(s.input_ids.shape[0] for s in samples)
    h = samples[0].final.shape[-1]
    dt = samples[0].final.dtype
    out = {"input_ids": torch.full((B, T), pad_id, dtype=torch.long),
           "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "attention_mask": torch.zeros(B, T, dtype=torch.bool),
           "aux": torch.zeros(B, T, 3, h, dtype=dt),                  # (B, T, 3, h)
           "final": torch.zeros(B, T, h, dtype=dt)}                   # (B, T, h)
    for b, s in enumerate(samples):
        n = s.input_ids.shape[0]
        out["input_ids"][b, :n] = s.input_ids
        out["loss_mask"][b, :n] = s.loss_mask
        out["attention_mask"][b, :n] = True
        out["aux"][b, :n] = s.aux
        out["final"][b, :n] = s.final
    return out
