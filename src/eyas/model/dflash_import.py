"""Import DFlash drafters in the engines' layout (eyas exports and published heads) as an eyas DFlashDrafter.

Open drafters with eyas.model.checkpoint.open_drafter, which finds the layout and calls this for a config.json whose
architectures hold "DFlashDraftModel".

Config: the Qwen3 sizes at the top level; dflash_config.target_layer_ids ("after layer k") become aux_layer_ids k + 1
(HF hidden_states indices); mask_token_id and block_size from dflash_config, else the top level; num_target_layers
from either, else the target's depth. Every dflash_config key the engines read (SGLang 0.5.14 / 0.5.23, vLLM 0.25 /
0.33) is known here: the ones eyas models are used; the ones that change the math (causal or sliding-window
attention, sinks, value scales, convolutions, selectors, other projectors) are accepted only at the value that
leaves it unchanged. A key no engine reads is refused by name: eyas cannot know what the head was trained with.
Weights: model.safetensors or a sharded index, names optionally under `model.`, the engines' `encoder.` aliases;
embed_tokens / lm_head (the target's in eyas) are ignored with a warning. An optional mask_embedding.pt (the sidecar
SGLang 0.5.23 and vLLM read) becomes the drafter's mask row.
"""

from __future__ import annotations

import json
import os
import warnings as pywarnings
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.model.importer import check_for_target, hf_shape, imported_meta, load_weights, named_state
from eyas.target.meta import read_json


ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"

# dflash_config keys eyas models (used as read).
USED_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "num_target_layers"}
# dflash_config keys the engines read -> the value(s) at which the engine's math is eyas's (None = absent).
NEUTRAL_KEYS: dict[str, tuple] = {
    "causal": (False, None),                    # vLLM: causal attention inside the block
    "use_swa": (False, None),                   # vLLM: sliding-window attention in every layer
    "swa_window_size": "any",                   # only read with use_swa
    "mask_token": "any",                        # SGLang: tokenizer lookup, used only without mask_token_id
    "use_aux_hidden_state": (True, None),       # vLLM: False drops the context path (no fc)
    "sample_from_anchor": (False, None),        # vLLM 0.33: DSpark drafting from the anchor slot
    "attention_sink_bias": (False, None),       # per-head sink logits
    "attention_value_scale": (None, 1, 1.0),    # V multiplied by a scale
    "output_multiplier": (None, 1, 1.0),        # SGLang 0.5.23: scaled logits
    "final_logit_softcapping": (None, 0, 0.0),  # SGLang 0.5.23: tanh soft-capped logits
    "conv_kernel_size": (None, 0),              # SGLang 0.5.23: grouped convolutions around each sublayer
    "conv_group_size": (None, 0),
    "selector_rank": (None, 0),                 # SGLang 0.5.23: candidate selector head
    "selector_top_k": (None, 0),
    "projector_type": (None,),                  # SGLang 0.5.23: the Domino projector
    "layer_ids": "any",                         # vLLM 0.33: ids taken as is; checked against target_layer_ids below
    # read by SGLang only with projector_type "domino", which is refused above
    "shift_label": "any", "pure_draft_prefix_len": "any", "gru_hidden_dim": "any", "emb_dim": "any",
}
# Top-level keys with the value at which the math is eyas's (absent counts as that value).
TOP_NEUTRAL = {"is_causal": (False, None), "attention_bias": (False, None), "use_gemma_norm": (False, None),
               "hidden_act": ("silu", None), "is_neox_style": (True, None), "rope_is_neox_style": (True, None),
               "partial_rotary_factor": (1, 1.0, None), "has_own_lm_head": (False, None), "logit_scale": (1, 1.0, None),
               "use_sliding_window": (False, None)}


def is_dflash_dir(path: Path) -> bool:
    """config.json names DFlashDraftModel among its architectures."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and ARCHITECTURE in (raw.get("architectures") or [])


def _check_neutral(d: dict, table: dict, where: str, what: str) -> None:
    for key, ok in table.items():
        if ok != "any" and key in d and d[key] not in ok:
            raise EyasError(f"{where}: {what}{key} = {d[key]!r} changes the drafter's math in the engines and eyas "
                            f"does not implement it (supported: {', '.join(repr(v) for v in ok if v is not None)})")


def dflash_config_from_hf(raw: dict, *, where: str, num_target_layers: int | None = None) -> DFlashConfig:
    """The engines' config.json -> DFlashConfig (see the module docstring)."""
    dc = raw.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise EyasError(f"{where}: dflash_config must be an object, got {type(dc).__name__}")
    unknown = sorted(set(dc) - USED_KEYS - set(NEUTRAL_KEYS))
    if unknown:
        raise EyasError(f"{where}: dflash_config key {unknown[0]!r} is unknown to eyas (and to the engines it "
                        f"checks); refusing rather than guessing what the head was trained with")
    _check_neutral(dc, NEUTRAL_KEYS, where, "dflash_config.")
    _check_neutral(raw, TOP_NEUTRAL, where, "")
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise EyasError(f"{where}: layer_types {raw['layer_types']} include sliding-window layers; eyas drafters are "
                        f"full attention only")
    if raw.get("draft_vocab_size") not in (None, raw.get("vocab_size")):
        raise EyasError(f"{where}: draft_vocab_size {raw['draft_vocab_size']} != vocab_size {raw.get('vocab_size')}; "
                        f"eyas DFlash drafters read the target's full LM head")
    ids = dc.get("target_layer_ids", raw.get("target_layer_ids"))
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EyasError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r} "
                        f"(without it the engines pick different defaults)")
    if "layer_ids" in dc and [int(i) for i in dc["layer_ids"]] != [i + 1 for i in ids]:
        raise EyasError(f"{where}: dflash_config.layer_ids {dc['layer_ids']} (HF indices, vLLM 0.33) disagree with "
                        f"target_layer_ids {ids} + 1")
    top_ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if top_ids is not None and [int(i) for i in top_ids] != [i + 1 for i in ids]:
        raise EyasError(f"{where}: eagle_aux_hidden_state_layer_ids {top_ids} (which vLLM prefers) disagree with "
                        f"dflash_config.target_layer_ids {ids} + 1")
    mask = dc.get("mask_token_id", raw.get("mask_token_id"))
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise EyasError(f"{where}: dflash_config.mask_token_id must be an int, got {mask!r} (eyas does not look the "
                        f"mask token up in a tokenizer)")
    block = dc.get("block_size", raw.get("block_size", 16))
    if "block_size" in dc and "block_size" in raw and dc["block_size"] != raw["block_size"]:
        raise EyasError(f"{where}: block_size {raw['block_size']} (top level) != dflash_config.block_size "
                        f"{dc['block_size']}")
    n = dc.get("num_target_layers", raw.get("num_target_layers", num_target_layers))
    if n is None:
        raise EyasError(f"{where}: no num_target_layers in the config; pass the target")
    if num_target_layers is not None and int(n) != num_target_layers:
        raise EyasError(f"{where}: num_target_layers {n} but the target has {num_target_layers} layers")
    try:
        return DFlashConfig(**hf_shape(raw, max_positions=32768), num_hidden_layers=int(raw["num_hidden_layers"]),
                            aux_layer_ids=tuple(i + 1 for i in ids), num_target_layers=int(n),
                            block_size=int(block), mask_token_id=int(mask))
    except KeyError as e:
        raise EyasError(f"{where}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise EyasError(f"{where}: bad DFlash config ({e})") from e


def _read_weights(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """model.safetensors, or the shards a model.safetensors.index.json names."""
    from safetensors.torch import load_file

    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        files, where = [single], single
    elif index.exists():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise EyasError(f"{index}: no weight_map")
        files, where = [path / f for f in sorted(set(wm.values()))], index
    else:
        raise EyasError(f"{path}: no weights (expected model.safetensors or model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ... on a damaged file
            raise EyasError(f"{f}: not a readable safetensors file ({type(e).__name__}: {' '.join(str(e).split())})") \
                from e
        clash = sorted(set(part) & set(state))
        if clash:
            raise EyasError(f"{f}: tensors {clash} also appear in another shard")
        state.update(part)
    return where, state


ALIASES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
IGNORED = ("embed_tokens.", "lm_head.")     # the target's own in eyas; SGLang drops them too


def canonical_name(name: str) -> str:
    """Published names -> eyas's: strip `model.`, the engines' `encoder.` aliases."""
    name = name[len("model."):] if name.startswith("model.") else name
    return ALIASES.get(name, name)


def read_mask_embedding(path: Path, cfg: DFlashConfig) -> torch.Tensor | None:
    """path/mask_embedding.pt as SGLang 0.5.23 reads it: {"embedding": Tensor[h], "mask_token_id": int}, loaded with
    weights_only (a pickle naming anything else is refused unrun); None when there is no such file."""
    p = path / MASK_EMBEDDING_FILE
    if not p.exists():
        return None
    try:
        with pywarnings.catch_warnings():
            pywarnings.simplefilter("ignore")
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types on a bad or unsafe file
        raise EyasError(f"{p}: unreadable ({type(e).__name__}); expected a dict saved with torch.save") from e
    h = cfg.hidden_size
    if not isinstance(obj, dict) or not isinstance(obj.get("embedding"), torch.Tensor):
        raise EyasError(f"{p}: expected a dict with a tensor 'embedding' of shape ({h},), got {type(obj).__name__}"
                        + (f" with keys {sorted(map(str, obj))}" if isinstance(obj, dict) else ""))
    row, mid = obj["embedding"], obj.get("mask_token_id")
    extra = sorted(set(map(str, obj)) - {"embedding", "mask_token_id"})
    if extra:
        raise EyasError(f"{p}: unexpected keys {extra} (per-position mask rows are not supported)")
    if tuple(row.shape) != (h,) or not row.is_floating_point():
        raise EyasError(f"{p}: embedding is {row.dtype} {tuple(row.shape)}, expected a float tensor of shape ({h},)")
    if mid is not None and (not isinstance(mid, int) or isinstance(mid, bool) or mid != cfg.mask_token_id):
        raise EyasError(f"{p}: mask_token_id {mid!r} != config.json's {cfg.mask_token_id}")
    return row.float()


def load_dflash_checkpoint(path: str | os.PathLike, *, target=None,
                           allow_target_mismatch: bool = False) -> tuple[DFlashDrafter, dict[str, Any]]:
    """An exported / published DFlash dir -> (DFlashDrafter fp32, meta).

    meta: {"format": "dflash", "source", "aux_layer_ids", "warnings", "target" (fingerprint, if recorded)}; with
    `target`, a recorded fingerprint that differs is refused (allow_target_mismatch: kept as a warning, the
    fingerprint moves to "trained_target"), and so are a different vocab, width or depth.
    """
    path = Path(path)
    where = str(path / "config.json")
    raw = read_json(path / "config.json", absent="missing")
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise EyasError(f"{where}: architectures {raw.get('architectures')} is not a DFlash drafter "
                        f"(expected {ARCHITECTURE!r})")
    cfg = dflash_config_from_hf(raw, where=where, num_target_layers=target.num_layers if target is not None else None)
    mismatch = check_for_target(raw, cfg, target, where=where, allow_mismatch=allow_target_mismatch)

    wpath, tensors = _read_weights(path)
    warnings: list[str] = []
    # HF's RoPE caches: derived from the config, skipped by both engines (canonical_name keeps "rotary_emb.")
    tensors = {name: t for name, t in tensors.items() if "rotary_emb." not in name}
    state = named_state(wpath, tensors, canonical_name, warnings, ignore=lambda c: c.startswith(IGNORED),
                        why="eyas uses the target's embedding and LM head")
    drafter = DFlashDrafter(cfg)
    load_weights(wpath, state, drafter.state_dict())
    drafter.set_mask_embedding(read_mask_embedding(path, cfg))
    return drafter, imported_meta("dflash", path, cfg.aux_layer_ids, warnings, raw, mismatch)
