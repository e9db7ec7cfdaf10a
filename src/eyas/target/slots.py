"""The cache layout, for either runner.

Runner and HFRunner (target/hf_runner.py) share it: per layer k_cache/v_cache (max_batch, kv, max_seq, hd) and
a dict `_graphs` of built steps. Decoders and the bench go through these, never through the fields themselves.
"""

from __future__ import annotations

from torch import Tensor


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
