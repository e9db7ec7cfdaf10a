"""A shard file in memory: host buffers laid out as the finished safetensors file (StoreWriter's overlap path).

`Staging` holds the pinned buffers the device->host copies land in; `Shard` packs a shard's rows into one
reusable buffer with room in front for the header, so the file is written from it with no further copy;
`st_header` writes exactly safetensors.save's header but with sorted metadata keys (save randomises their order,
which made equal captures differ in sha256).
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import torch
from safetensors.torch import save as st_save

STAGING = 3          # pinned host buffers the device->host copies rotate through
_LEAD = 1 << 20      # room kept in front of a shard's rows for the header and the tensors laid out before them
_PER_TOKEN = 32      # room a token needs for the other tensors: int32 id, uint8 mask, int64 offset, 4 fp32 scales


@functools.cache
def st_order(dtypes: tuple[tuple[str, torch.dtype], ...]) -> tuple[tuple[str, str], ...]:
    """(name, safetensors dtype) in the order safetensors.save lays the tensors out, asked of the library."""
    data = st_save({k: torch.zeros(1, dtype=d) for k, d in dtypes})
    head = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
    return tuple(sorted(((k, head[k]["dtype"]) for k, _ in dtypes), key=lambda e: head[e[0]]["data_offsets"][0]))


def st_header(entries, metadata: dict[str, str]) -> bytes:
    """The safetensors header of `entries` [(name, dtype, shape, nbytes)] in layout order, as safetensors.save
    writes it, except that the metadata keys are sorted: save emits them in a random order (a Rust HashMap), so
    two captures of the same data would differ in their shards' sha256 (docs/store.md)."""
    head, off = {"__metadata__": dict(sorted(metadata.items()))}, 0
    for name, dtype, shape, nbytes in entries:
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    return len(text).to_bytes(8, "little") + text


def canonical(data: bytes) -> bytes:
    """safetensors.save output with st_header's header: the same tensors and length, the metadata sorted."""
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8: 8 + n])
    meta = head.pop("__metadata__")
    entries = sorted(((v["data_offsets"][0], k, v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
                      for k, v in head.items()))
    new = st_header([e[1:] for e in entries], meta)
    assert len(new) == 8 + n and json.loads(new[8:]) == {"__metadata__": meta, **head}, "safetensors header changed"
    return data if new == data[: 8 + n] else new + data[8 + n:]


def shard_tensors(lengths: list[int], input_ids: list, loss_mask: list, scale: list) -> dict[str, torch.Tensor]:
    """A shard's tensors other than `hidden`, from its batches."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    out = {"input_ids": torch.cat(input_ids).to(torch.int32), "loss_mask": torch.cat(loss_mask).to(torch.uint8),
           "offsets": offsets}
    if scale:
        out["scale"] = torch.cat(scale).float()
    return out


class Staging:
    """Pinned host buffers one batch is copied into from the device; `free` is set once the intake has packed it."""

    def __init__(self):
        self.free = threading.Event()
        self.free.set()
        self.bufs: dict[str, torch.Tensor] = {}

    def view(self, key: str, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            grow = 0 if buf is None else buf.numel() * 5 // 4
            buf = self.bufs[key] = torch.empty(max(nbytes, grow), dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes].view(like.dtype).view(like.shape)


class Shard:
    """The shard being packed, in a reusable host buffer laid out as the finished file: `hidden` rows from `lead`
    on; when it closes, the header and the tensors safetensors puts before `hidden` go just in front of them and
    the ones after it just behind, so the file is one slice of the buffer (no concatenation, and no fresh pages
    to fault in for every shard: the buffers cycle through a pool)."""

    def __init__(self):
        self.mem = torch.empty(0, dtype=torch.uint8)
        self.lead = self.cap = self.row = 0
        self.tail: tuple = ()
        self.reset()

    def reset(self) -> None:
        self.rows, self.ids, self.lengths, self.input_ids, self.loss_mask, self.scale = 0, [], [], [], [], []

    @property
    def nbytes(self) -> int:
        return self.rows * self.row

    def _move(self, cap: int, lead: int, size: int = 0) -> None:
        """Reallocate for `cap` rows with `lead` bytes in front, keeping the rows packed so far."""
        lead = -(-lead // 64) * 64
        mem = torch.empty(max(lead + cap * (self.row + _PER_TOKEN), size), dtype=torch.uint8)
        mem[lead: lead + self.nbytes] = self.mem[self.lead: self.lead + self.nbytes]
        self.mem, self.lead, self.cap = mem, lead, cap

    def add(self, ids, lengths, input_ids, loss_mask, hidden, scale, shard_bytes: int) -> None:
        n = hidden.shape[0]
        self.row, self.tail = hidden[0].numel() * hidden.element_size(), hidden.shape[1:]
        if self.rows + n > self.cap:
            cap = max(self.rows + n, self.cap * 3 // 2, min(shard_bytes, 1 << 30) // self.row + 2 * n)
            self._move(cap, _LEAD + _PER_TOKEN * cap)
        at = self.lead + self.nbytes
        self.mem[at: at + n * self.row].view(hidden.dtype).view(hidden.shape).copy_(hidden)  # (n, 4, h)
        self.rows += n
        self.ids += ids
        self.lengths += lengths
        self.input_ids.append(input_ids.cpu())
        self.loss_mask.append(loss_mask.cpu())
        if scale is not None:
            self.scale.append(scale.clone())  # out of the staging buffer

    def finish(self, order, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> memoryview:
        """Write the header and the other tensors around the rows: the finished file, one slice of the buffer."""
        entries, before, after = [], [], []
        side = before
        for name, dtype in order:
            if name == "hidden":
                entries.append((name, dtype, (self.rows, *self.tail), self.nbytes))
                side = after
                continue
            raw = tensors[name].contiguous().view(torch.uint8).reshape(-1)
            entries.append((name, dtype, tensors[name].shape, raw.numel()))
            side.append(raw)
        head = st_header(entries, metadata)
        front = len(head) + sum(t.numel() for t in before)
        back = sum(t.numel() for t in after)
        if front > self.lead or self.lead + self.nbytes + back > self.mem.numel():  # rare: very long sample ids
            self._move(self.cap, front + _LEAD, front + _LEAD + self.nbytes + back + 64)
        arr = self.mem.numpy()
        at = self.lead - front
        arr[at: at + len(head)] = np.frombuffer(head, dtype=np.uint8)
        at += len(head)
        for t in before + [None] + after:
            if t is None:
                at += self.nbytes
                continue
            arr[at: at + t.numel()] = t.numpy()
            at += t.numel()
        return memoryview(arr[self.lead - front: at])
