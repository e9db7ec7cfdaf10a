"""The target's final RMSNorm, read from its checkpoint: vLLM captures the final state before it.

vLLM's extract_hidden_states stores, for layer id N (= num_hidden_layers), `hidden_states + residual`
before `self.norm` (model_executor/models/llama.py `_maybe_add_hidden_state(aux, idx + 1, ...)` then
`self.norm(...)`; deepseek_v2.py appends `hidden_states + residual` when end_layer is requested, then
norms), and nothing after the norm. eyas's store holds the final-norm output, whose lm_head is the
target's logits (EAGLE3.md section 1), so the vLLM ingester applies this norm to that slot.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import EyasError

NORM_KEY = re.compile(r"(?:^|\.)model\.norm\.weight$")   # model.norm.weight, language_model.model.norm.weight


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
    """tensor name -> safetensors file, from the index when there is one."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        return {k: d / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open  # noqa: PLC0415
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f for k in sf.keys()})
    return out


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
    keys = [k for k in _checkpoint_keys(d) if NORM_KEY.search(k)] if d.is_dir() else []
    if len(keys) != 1:
        raise EyasError(f"{d}: expected one final-norm tensor (*model.norm.weight) in the target's safetensors, "
                        f"found {keys or 'none'}")
    from safetensors import safe_open  # noqa: PLC0415
    with safe_open(str(_checkpoint_keys(d)[keys[0]]), framework="pt") as sf:
        w = sf.get_tensor(keys[0])
    h = int(text.get("hidden_size", w.shape[0]))
    if tuple(w.shape) != (h,):
        raise EyasError(f"{d}: {keys[0]} has shape {tuple(w.shape)}, expected ({h},)")
    return FinalNorm(w, float(text["rms_norm_eps"]))
