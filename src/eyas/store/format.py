"""The hidden-state store on disk: names, tensor layout, fp8 scheme. See docs/store.md.

STORE/
  manifest.json                        header (target, layers, dtype, ...) + shard list + complete flag
  shard-r{rank:03d}-{index:05d}.safetensors
  shard-r{rank:03d}-{index:05d}.json   sidecar = the commit record of that shard (written after the rename)

One shard holds S samples with N tokens in total, concatenated in sample order:
  input_ids  int32   (N,)
  loss_mask  uint8   (N,)
  offsets    int64   (S+1,)    sample j is tokens offsets[j]:offsets[j+1]
  hidden     bf16 | float8_e4m3fn (N, 4, h)   slots 0..2 = aux (low, mid, high), slot 3 = final norm output
  scale      float32 (N, 4)    fp8 only: hidden ~= hidden_q.float() * scale[..., None]
"""

from __future__ import annotations

import re

import torch

FORMAT = "eyas-store-v1"
KIND = "store"
LAYER_CONVENTION = "hf_hidden_states"  # aux id i = hidden_states[i] = residual stream entering decoder layer i
NUM_STATES = 4                          # 3 aux + final
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0                         # largest finite float8_e4m3fn
SHARD_RE = re.compile(r"^shard-r(\d{3})-(\d{5})\.safetensors$")
SIDECAR_RE = re.compile(r"^shard-r(\d{3})-(\d{5})\.json$")


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:03d}-{index:05d}.safetensors"


def sidecar_name(shard: str) -> str:
    return shard[: -len(".safetensors")] + ".json"


def bytes_per_token(dtype: str, hidden_size: int) -> int:
    """input id (4) + loss mask (1) + 4 states (+ 4 fp32 scales for fp8)."""
    if dtype == "bf16":
        return 5 + NUM_STATES * hidden_size * 2
    return 5 + NUM_STATES * hidden_size + NUM_STATES * 4


def identity(header: dict) -> dict:
    """The fields that make two stores the same configuration (resume allowed only if equal)."""
    return {k: header.get(k) for k in ("format", "target", "layers", "dtype", "hidden_size", "data")}


def quantize(hidden: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(..., 4, h) float -> stored tensor (+ fp8 per-token, per-state float32 scale (..., 4))."""
    if dtype == "bf16":
        return hidden.to(torch.bfloat16), None
    x = hidden.float()
    amax = x.abs().amax(dim=-1)                                    # (..., 4)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return q.to(dtype)
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
