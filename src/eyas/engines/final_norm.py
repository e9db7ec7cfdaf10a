"""The target's final RMSNorm, read from its checkpoint: vLLM captures the final state before it.

vLLM's extract_hidden_states stores, for layer id N (= num_hidden_layers), `hidden_states + residual`
before `self.norm` (model_executor/models/llama.py `_maybe_add_hidden_state(aux, idx + 1, ...)` then
`self.norm(...)`; deepseek_v2.py appends `hidden_states + residual` when end_layer is requested, then
norms), and nothing after the norm. eyas's store holds the final-norm output, whose lm_head is the
target's logits (EAGLE3.md section 1), so the vLLM ingester applies this norm to that slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.target.meta import INDEX, NAMES, SINGLE, find_name, read_config, read_tensor, weight_map

# The final norm's names (target/meta.py, as every stage finds them): HF causal LMs, multimodal wrappers
# (Kimi-K2.5), and NVIDIA's Kimi-K2.5 quantized checkpoints (language_model.layers.*, language_model.norm.weight).
NORM_KEYS = NAMES["norm"]


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor    # (h,)
    eps: float

    def __call__(self, pre: torch.Tensor) -> torch.Tensor:
        """(T, h) residual stream after the last layer -> (T, h) float32 final-norm output."""
        x = pre.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)    # (T, h)
        return x * self.weight.float()


def read_norm_weight(d: Path) -> tuple[str, torch.Tensor]:
    """(name, weight) of the final norm in the safetensors of `d`: found by name through the weight map
    (target/meta.py find_name), read memory-mapped from its one shard."""
    found = weight_map(d) if d.is_dir() else None
    if found is None:
        raise EyasError(f"{d}: no {INDEX} or {SINGLE}; expected one final-norm tensor named "
                        f"{' or '.join(NORM_KEYS)} in its safetensors")
    wm, where = found
    name = find_name(wm, "norm")
    if name is None:
        raise EyasError(f"{where}: expected one final-norm tensor named {' or '.join(NORM_KEYS)}; found none")
    shard = d / wm[name]
    if not shard.is_file():
        raise EyasError(f"{shard}: absent, but {where} puts the final norm {name} there")
    from safetensors import SafetensorError  # noqa: PLC0415
    try:
        return name, read_tensor({"name": name, "path": shard})
    except SafetensorError as e:
        raise EyasError(f"{shard}: cannot read {name} ({e})") from e


def load_final_norm(target_config, weights_dir=None) -> FinalNorm:
    """The final norm of the target whose HF config.json is `target_config` (weights beside it by default)."""
    p = Path(target_config)
    cfg, text = read_config(p)
    model_type = str(text.get("model_type") or cfg.get("model_type") or "")
    if model_type.startswith("gemma"):
        raise EyasError(f"{p}: {model_type} scales its norm by (1 + weight); eyas's vLLM ingest supports plain RMSNorm")
    if "rms_norm_eps" not in text:
        raise EyasError(f"{p}: no rms_norm_eps; cannot rebuild the final norm that vLLM's last slot lacks")
    d = Path(weights_dir) if weights_dir else p.parent
    name, w = read_norm_weight(d)
    h = int(text.get("hidden_size", w.shape[0]))
    if tuple(w.shape) != (h,):
        raise EyasError(f"{d}: {name} has shape {tuple(w.shape)}, expected ({h},)")
    return FinalNorm(w, float(text["rms_norm_eps"]))
