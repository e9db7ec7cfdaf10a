"""The feature cache of online training: each sample's target states, kept from their first forward, so that later
epochs and evals gather them instead of running the target again (`--feature-cache auto | GB | off`).

One flat buffer of (capacity, 4h) rows, each a token's concat(aux (3h), final (h)) in the features' own dtype (what
target_features returns, never a lossier one); a sample's valid tokens take consecutive rows from the offset given at
its first put. First come, first kept: once a sample does not fit, the cache is full and the rest stay online.
Where: on the training device up to the room left there after a margin; on CUDA, what does not fit goes on in
pinned host memory (a second buffer, copied to the device per micro-batch), up to the host's room.
A batch assembled from the cache is the online path's: the states the target gave on valid positions, zeros on
padding (target_features zeroes its padding too). Each DDP rank keeps the samples of its own micro-batches; a
resumed run starts empty and refills online.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

from eyas.target.device import memory
from eyas.train.config import feature_cache_budget
from eyas.train.data import Batch, h2d, target_features

DEVICE_MARGIN = (16e9, 0.2)
"""(bytes, share of the card) left free on a CUDA device, the larger of the two: training's own peak (activations,
AdamW state, compile workspaces) grows after the room is measured at start."""
HOST_MARGIN = (4e9, 0.25)
"""(bytes, share of RAM) of the host's available memory left to everything else."""


def host_room(local_world: int = 1) -> int:
    """Bytes of host memory a rank may take: MemAvailable less HOST_MARGIN, shared by the ranks of this host."""
    avail, total = memory("cpu")
    return int(avail - max(HOST_MARGIN[0], HOST_MARGIN[1] * total)) // max(1, local_world)


def device_room(device: torch.device) -> int:
    """Bytes free on a CUDA device now, less DEVICE_MARGIN."""
    free, total = memory(device)
    return int(free - max(DEVICE_MARGIN[0], DEVICE_MARGIN[1] * total))


def plan(setting: str, needed: int, device: torch.device, rooms: tuple[int, int] | None = None
         ) -> tuple["FeatureCache | Tiers | None", str]:
    """(the cache for `needed` bytes of states under `setting`, or None; a line saying where and how much).
    The device takes what fits its room; on CUDA the rest goes to pinned host memory, so a cache too big for
    either room alone is held whole by both (a `Tiers`: the device's part filled first).
    rooms: (device room, host room) in bytes, measured now when not given; on the CPU the device is the host."""
    budget = feature_cache_budget(setting)
    if budget is None:
        return None, "off"
    if rooms is None:
        host = host_room(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        rooms = (device_room(device) if device.type == "cuda" else host, host)
    dev, host = rooms
    cap = needed if budget == "auto" else min(needed, int(budget))
    on_dev = max(0, min(cap, dev))
    parts = [FeatureCache(on_dev, device)] if on_dev > 0 else []
    if device.type == "cuda" and cap > on_dev and host > 0:
        # pinned: torch's host allocator takes a request rounded up to a power of two, so that is the room
        on_host = min(cap - on_dev, 1 << (int(host).bit_length() - 1))
        parts.append(FeatureCache(on_host, torch.device("cpu"), pinned=True))
    if not parts:
        return None, f"off (no room: {_size(dev)} on {device}, {_size(host)} on the host)"
    held = sum(p.capacity_bytes for p in parts)
    share = f"all {_size(needed)}" if held >= needed else f"{held / needed:.0%} of {_size(needed)}"
    places = " + ".join(f"{_size(p.capacity_bytes)} in {'pinned host memory' if p.pinned else p.device}"
                        for p in parts)
    return (parts[0] if len(parts) == 1 else Tiers(parts)), f"{places} ({share} of states)"


def _size(n: float) -> str:
    for unit, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if abs(n) >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n:.0f} bytes"


def _rows_of(lengths: list[int], rows: list[int], offsets: list[int] | None = None):
    """Flat token indices of the first lengths[j] positions of batch rows `rows`: (row, position) and, with offsets,
    the cache row of each (offsets[j] + position)."""
    n = torch.tensor(lengths, dtype=torch.long)                                        # (S,)
    pos = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)      # (N,) 0..n-1 per sample
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), n)             # (N,)
    src = None if offsets is None else torch.repeat_interleave(torch.tensor(offsets, dtype=torch.long), n) + pos
    return row, pos, src


class FeatureCache:
    """Target states by sample index: `put` keeps a computed batch's new samples while there is room, `gather`
    builds (aux, final) of a micro-batch from the samples it holds."""

    def __init__(self, capacity_bytes: int, device: torch.device, pinned: bool = False):
        self.capacity_bytes, self.device, self.pinned = int(capacity_bytes), torch.device(device), pinned
        self.buf: Tensor | None = None      # (rows, 3h + h), allocated at the first put (the features' dtype)
        self.aux_width = 0
        self.at: dict[int, tuple[int, int]] = {}   # sample index -> (first row, rows)
        self.top = 0
        self.full = False
        self._copies: list = []             # CUDA events of device-to-host copies into buf not yet waited for

    def __contains__(self, i: int) -> bool:
        return i in self.at

    def _alloc(self, aux: Tensor, final: Tensor) -> None:
        width = aux.shape[-1] + final.shape[-1]
        rows = self.capacity_bytes // (width * aux.element_size())
        self.aux_width = aux.shape[-1]
        try:
            self.buf = torch.empty(rows, width, dtype=aux.dtype, device=self.device,   # (rows, 4h)
                                   pin_memory=self.pinned)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # the room was measured, but not held
            print(f"eyas train: feature cache: could not allocate {self.capacity_bytes / 1e9:.2f} GB on "
                  f"{'pinned host memory' if self.pinned else self.device} ({str(e).splitlines()[0]}); the target "
                  f"runs every step", file=sys.stderr)
            self.buf, self.full = None, True

    def put(self, idx: list[int], batch: Batch, lengths: list[int], rows: list[int] | None = None) -> None:
        """Keep the states of batch rows whose sample (idx[r], lengths[r] valid tokens) is new, in row order, while
        they fit; rows: only those rows (all when None)."""
        if self.full:
            return
        if self.buf is None:
            self._alloc(batch.aux, batch.final)
            if self.buf is None:
                return
        new, offsets = [], []
        for r in range(len(idx)) if rows is None else rows:
            i = idx[r]
            if i in self.at:
                continue
            if self.top + lengths[r] > self.buf.shape[0]:
                self.full = True
                break
            self.at[i] = (self.top, lengths[r])
            new.append(r)
            offsets.append(self.top)
            self.top += lengths[r]
        if not new:
            return
        row, pos, _ = _rows_of([lengths[r] for r in new], new)
        dev = batch.aux.device
        row, pos = h2d(row, dev), h2d(pos, dev)
        states = torch.cat([batch.aux[row, pos], batch.final[row, pos]], dim=-1)      # (N, 4h)
        dst = self.buf[offsets[0]:offsets[0] + states.shape[0]]
        dst.copy_(states, non_blocking=True)
        if dst.device.type == "cpu" and states.device.type == "cuda":   # read on the host later: wait for it then
            ev = torch.cuda.Event()
            ev.record()
            self._copies.append(ev)

    def gather(self, idx: list[int], lengths: list[int], shape: tuple[int, int], device: torch.device
               ) -> tuple[Tensor, Tensor]:
        """(aux (B, T, 3h), final (B, T, h)) on `device`: zeros, with the rows of the samples held filled in."""
        B, T = shape
        aux = torch.zeros(B, T, self.aux_width, dtype=self.buf.dtype, device=device)                # (B, T, 3h)
        final = torch.zeros(B, T, self.buf.shape[1] - self.aux_width, dtype=self.buf.dtype, device=device)  # (B, T, h)
        self.fill(aux, final, idx)
        return aux, final

    def fill(self, aux: Tensor, final: Tensor, idx: list[int]) -> None:
        """Write the held samples' states into rows of aux (B, T, 3h) and final (B, T, h); the rest untouched."""
        hits = [r for r, i in enumerate(idx) if i in self.at]
        if not hits:
            return
        device = aux.device
        row, pos, src = _rows_of([self.at[idx[r]][1] for r in hits], hits, [self.at[idx[r]][0] for r in hits])
        if self.buf.device == device:
            states = self.buf[h2d(src, device)]                                     # (N, 4h)
        else:  # pinned host -> device: gather on the host into pinned memory, one asynchronous copy
            for ev in self._copies:
                ev.synchronize()
            self._copies = []
            staged = torch.empty(len(src), self.buf.shape[1], dtype=self.buf.dtype,
                                 pin_memory=device.type == "cuda")                   # (N, 4h)
            torch.index_select(self.buf, 0, src, out=staged)
            states = staged.to(device, non_blocking=True)
        row, pos = h2d(row, device), h2d(pos, device)
        aux[row, pos] = states[:, :self.aux_width]
        final[row, pos] = states[:, self.aux_width:]

    def release(self) -> None:
        """Drop the buffer (the run is over); a CUDA one goes back to the device."""
        on_cuda = self.buf is not None and self.buf.is_cuda
        self.buf, self.at, self.top, self.full = None, {}, 0, True
        if on_cuda:
            torch.cuda.empty_cache()


class Tiers:
    """A cache in parts (the device's, then pinned host memory's) with FeatureCache's interface: a new sample goes to
    the first part that is not full, and a part once full stays so (first come, first kept, across the parts)."""

    def __init__(self, parts: list[FeatureCache]):
        self.parts = parts
        self.device = parts[0].device

    def __contains__(self, i: int) -> bool:
        return any(i in p for p in self.parts)

    def put(self, idx: list[int], batch: Batch, lengths: list[int]) -> None:
        rows = [r for r, i in enumerate(idx) if i not in self]
        for p in self.parts:
            if not rows:
                return
            p.put(idx, batch, lengths, rows)
            rows = [r for r in rows if idx[r] not in p]

    def gather(self, idx: list[int], lengths: list[int], shape: tuple[int, int], device: torch.device
               ) -> tuple[Tensor, Tensor]:
        held = [p for p in self.parts if p.buf is not None]
        aux, final = held[0].gather(idx, lengths, shape, device)
        for p in held[1:]:
            p.fill(aux, final, idx)
        return aux, final

    def release(self) -> None:
        for p in self.parts:
            p.release()


def online_features(cache: "FeatureCache | Tiers | None", target, batch: Batch, idx: list[int], lengths: list[int],
                    sub_tokens: int | None) -> Batch:
    """`batch` (samples idx, on the device) with aux and final filled: gathered where the cache holds the sample,
    from target_features (sub_tokens, lengths: its arguments) for the others, which the cache then keeps."""
    if cache is None:
        return target_features(target, batch, sub_tokens=sub_tokens, lengths=lengths)
    miss = [r for r, i in enumerate(idx) if i not in cache]
    if len(miss) == len(idx):       # nothing held: the plain online path
        batch = target_features(target, batch, sub_tokens=sub_tokens, lengths=lengths)
        cache.put(idx, batch, lengths)
        return batch
    aux, final = cache.gather(idx, lengths, tuple(batch.input_ids.shape), batch.input_ids.device)
    if miss:                        # the target runs on the missing rows only, cut to their longest
        n = [lengths[r] for r in miss]
        m, Tm = h2d(torch.tensor(miss), batch.input_ids.device), max(n)
        sub = target_features(target, Batch([batch.ids[r] for r in miss], batch.input_ids[m, :Tm],
                                            batch.loss_mask[m, :Tm], batch.valid[m, :Tm]),
                              sub_tokens=sub_tokens, lengths=n)
        m = h2d(m, aux.device)
        aux[m, :Tm], final[m, :Tm] = sub.aux, sub.final
        cache.put([idx[r] for r in miss], sub, n)
    batch.aux, batch.final = aux, final
    return batch
