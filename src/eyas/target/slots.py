"""The cache layout, for either runner.

Runner and HFRunner (target/hf_runner.py) share it: per layer k_cache/v_cache (max_batch, kv, max_seq, hd) and
a dict `_graphs` of built steps. Decoders and the bench go through these (SlotRunner's methods), never through the
fields themselves.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def copy_slots(layers, src: Tensor, dst: Tensor, row: int = 0) -> None:
    """Cache entries src[i] -> dst[i] (1-D long) of one row, in every layer that has a cache (a runner's
    `copy_slots`: Runner's layers and HFRunner's slot cache alike)."""
    for layer in layers:
        if layer.k_cache is not None:
            layer.k_cache[row, :, dst] = layer.k_cache[row, :, src]
            layer.v_cache[row, :, dst] = layer.v_cache[row, :, src]


def move_rows(layers, keep: Tensor, width: int) -> None:
    """Cache rows `keep` (1-D long) of slots [:width] become rows 0..len(keep)-1, in every layer that has a cache
    (a runner's `move_rows`)."""
    m = keep.numel()
    for layer in layers:
        if layer.k_cache is not None:
            layer.k_cache[:m, :, :width] = layer.k_cache[keep, :, :width]
            layer.v_cache[:m, :, :width] = layer.v_cache[keep, :, :width]


class SlotRunner(nn.Module):
    """What Runner and HFRunner share: their placement (that of their input embedding `embed`) and, over their
    `layers`' caches and the steps `graphed` built (`_graphs`), slot copies, row moves and the built-step count."""

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def copy_slots(self, src: Tensor, dst: Tensor, row: int = 0) -> None:
        """Move cache entries src[i] -> dst[i] (1-D long tensors) in every layer for one row (tree compaction)."""
        copy_slots(self.layers, src, dst, row)

    def move_rows(self, keep: Tensor, width: int) -> None:
        """Cache rows `keep` (1-D long) of slots [:width] become rows 0..len(keep)-1 in every layer: batched
        decoders move their live rows to the front and continue at a smaller batch."""
        move_rows(self.layers, keep, width)

    @property
    def graph_count(self) -> int:
        """Steps `graphed` has built (captured CUDA graphs on CUDA, plain calls elsewhere and in HFRunner): the bench
        counts the ones built late."""
        return len(self._graphs)
