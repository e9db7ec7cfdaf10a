"""The target's final RMSNorm, read from its checkpoint: vLLM captures the final state before it.

vLLM's extract_hidden_states stores, for layer id N (= num_hidden_layers), `hidden_states + residual`
before `self.norm` (model_executor/models/llama.py `_maybe_add_hidden_state(aux, idx + 1, ...)` then
`self.norm(...)`; deepseek_v2.py appends `hidden_states + residual` when end_layer is requested, then
norms), and nothing after the norm. eyas's store holds the final-norm output, whose lm_head is the
target's logits (EAGLE3.md section 1), so the vLLM ingester applies this norm to that slot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import EyasError

# The final norm's name in the checkpoints eyas knows: HF causal LMs, multimodal wrappers (Kimi-K2.5), and
# NVIDIA's Kimi-K2.5 quantized checkpoints (language_model.layers.*, language_model.norm.weight).
NORM_KEYS = ("model.norm.weight", "language_model.model.norm.weight", "language_model.norm.weight")
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor    # (h,)
    eps: float

    def __call__(self, pre: torch.Tensor) -> torch.Tensor:
        """(T, h) residual stream after the last layer -> (T, h) float32 final-norm output."""
        x = pre.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)    # (T, h)
        return x * self.weight.float()


def _checkpoint_keys(d: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when there is one (no shard opened)."""
    index = d / INDEX
    if index.exists():
        try:
            return {k: d / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise EyasError(f"{index}: cannot read its weight_map ({e})") from e
    from safetensors import safe_open  # noqa: PLC0415
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f for k in sf.keys()})
    return out


def read_norm_weight(d: Path) -> tuple[str, torch.Tensor]:
    """(name, weight) of the final norm in the safetensors of `d`: found by name through the index, read
    memory-mapped from its one shard."""
    keys = _checkpoint_keys(d) if d.is_dir() else {}
    found = [k for k in NORM_KEYS if k in keys]
    where = d / INDEX if (d / INDEX).exists() else f"{d}/*.safetensors"
    if len(found) != 1:
        what = f"found {' and '.join(found)}" if found else "found none"
        raise EyasError(f"{where}: expected one final-norm tensor named {' or '.join(NORM_KEYS)}; {what}")
    shard = keys[found[0]]
    if not shard.is_file():
        raise EyasError(f"{shard}: absent, but {where} puts the final norm {found[0]} there")
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415
    try:
        with safe_open(str(shard), framework="pt") as sf:
            return found[0], sf.get_tensor(found[0])
    except SafetensorError as e:
        raise EyasError(f"{shard}: cannot read {found[0]} ({e})") from e


def load_final_norm(target_config, weights_dir=None) -> FinalNorm:
    """The final norm of the target whose HF config.json is `target_config` (weights beside it by default)."""
    p = Path(target_config)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EyasError(f"{p}: cannot read the target config ({e})") from e
    text = cfg.get("text_config") or cfg
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
