"""Import EAGLE-3 drafters in the published (and eyas-exported) layout as an eyas Eagle3Drafter.

Open drafters with eyas.model.checkpoint.open_drafter, which finds the layout and calls this for EAGLE-3 dirs.

Accepted: `midlayer.*` or `layers.0.*` names (optionally under `model.`), with or without `t2d`
(rebuilt from d2t) or both maps (full vocab: identities); architectures LlamaForCausalLM or
LlamaForCausalLMEagle3; aux layer ids as HF indices (top-level, vLLM), as SGLang ids
(eagle_config, HF - 1), both (must agree) or neither (EAGLE default for the target's depth).
`embed_tokens` is ignored with a warning: eyas always uses the frozen target embedding. `norm_before_fc` (EAGLE 3.1)
is read where the engines read it and then needs `input_norm.weight`; a checkpoint without the key has no such norm.
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.manifest import check_target
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.model.shape import target_rope
from eyas.target.layers import check_aux_layer_ids, default_aux_layer_ids, sglang_capture_ids, sglang_capture_readings
from eyas.target.meta import read_json

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _read_weights(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    for name in WEIGHT_FILES:
        p = path / name
        if p.exists():
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return p, load_file(str(p))
                # weights_only: a pickle that names anything but tensors and plain containers is refused unrun
                with warnings.catch_warnings():  # a foreign pickle protocol warns before being refused
                    warnings.simplefilter("ignore")
                    state = torch.load(p, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - safetensors / torch.load raise many types on a bad file
                msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e):
                    msg = "a pickle that holds more than tensors; refused without running it"
                raise EyasError(f"{p}: unreadable weights ({type(e).__name__}: {msg})") from e
            if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in state.items()):
                raise EyasError(f"{p}: not a state dict of named tensors")
            return p, state
    raise EyasError(f"{path}: no weights (expected one of {', '.join(WEIGHT_FILES)})")


def resolve_layer_ids(raw: dict, *, num_target_layers: int | None, where: str, warnings: list[str],
                      arch: str | None = None, model_type: str | None = None) -> tuple[int, int, int]:
    """HF hidden_states indices from a config's top-level (HF, vLLM) and/or eagle_config (SGLang) ids.

    SGLang ids are mapped back with the target's architecture (`arch`/`model_type`, target/layers.py); with
    neither known, both SGLang conventions (+1, and DeepSeek's +1-only-if-first-is-1) are accepted as agreeing.
    """
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    sg = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_sg = sglang_capture_ids(sg, arch, model_type) if sg else None
    if top and from_sg:
        top = [int(i) for i in top]
        agree = [from_sg] if arch or model_type else sglang_capture_readings(sg)
        if top not in agree:
            raise EyasError(f"{where}: layer ids disagree: top-level (HF/vLLM) {top} vs eagle_config (SGLang) "
                            f"{list(sg)}, which means HF {from_sg}")
    ids = [int(i) for i in top] if top else from_sg
    if ids is None:
        if num_target_layers is None:
            raise EyasError(f"{where}: no aux layer ids in the config; pass the target so the EAGLE default "
                            f"(2, N//2, N-3) can be used")
        ids = list(default_aux_layer_ids(num_target_layers))
        msg = f"{where}: no aux layer ids in the config; using the EAGLE default {ids} for {num_target_layers} layers"
        log.warning(msg)
        warnings.append(msg)
    if len(ids) != 3:
        raise EyasError(f"{where}: expected 3 aux layer ids, got {ids}")
    if num_target_layers is not None:
        try:
            check_aux_layer_ids(ids, num_target_layers)
        except EyasError as e:
            raise EyasError(f"{where}: {e}") from e
    return tuple(ids)


def drafter_config_from_hf(raw: dict, *, aux_layer_ids, where: str):
    nbf = norm_before_fc(raw, where)
    try:
        return DrafterConfig(**hf_shape(raw, max_positions=2048),
                             draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                             aux_layer_ids=aux_layer_ids, norm_before_fc=nbf)
    except KeyError as e:
        raise EyasError(f"{where}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise EyasError(f"{where}: bad drafter config ({e})") from e


def norm_before_fc(raw: dict, where: str) -> bool:
    """EAGLE 3.1's flag as both engines read it: eagle_config's value, else the top-level one, else off. The
    per-aux-slot variant (`fc_norm` / `use_aux_norm`, weights fc_norm.{0,1,2}) is another model: refused by name."""
    if raw.get("fc_norm") or raw.get("use_aux_norm"):
        raise EyasError(f"{where}: fc_norm / use_aux_norm (one RMSNorm per aux slot) is not supported by eyas; "
                        f"only norm_before_fc (one RMSNorm over the concatenation)")
    return bool((raw.get("eagle_config") or {}).get("norm_before_fc", raw.get("norm_before_fc", False)))


def canonical_name(name: str) -> str:
    """Published names -> eyas/export names: strip `model.`, layers.0. -> midlayer."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor | None, *, vocab_size: int, where: str) -> torch.Tensor:
    """Validate d2t (target_id = i + d2t[i], in range, strictly increasing); returns t2d (given or rebuilt)."""
    tok = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    bad = ((tok < 0) | (tok >= vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise EyasError(f"{where}: d2t[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(tok[i])}, outside "
                        f"the target vocab 0..{vocab_size - 1} ({bad.numel()} such entries)")
    if tok.numel() > 1 and not bool((tok[1:] > tok[:-1]).all()):
        raise EyasError(f"{where}: d2t does not map draft ids to distinct ascending target ids")
    rebuilt = torch.zeros(vocab_size, dtype=torch.bool)
    rebuilt[tok] = True
    if t2d is not None:
        if tuple(t2d.shape) != (vocab_size,):
            raise EyasError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},)")
        if not torch.equal(t2d.to(torch.bool), rebuilt):
            raise EyasError(f"{where}: t2d does not mark exactly the target ids that d2t maps to")
    return rebuilt


def named_state(wpath, tensors: dict[str, torch.Tensor], rename, warnings: list[str], *, ignore,
                why: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under eyas's names (`rename`), refusing two that map to one name. A tensor whose eyas
    name `ignore` selects is not the drafter's: left out with a warning (logged and added to `warnings`) that says
    `why`."""
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        c = rename(name)
        if ignore(c):
            msg = f"{wpath}: ignoring {name!r} {tuple(t.shape)}: {why}"
            log.warning(msg)
            warnings.append(msg)
            continue
        if c in state:
            raise EyasError(f"{wpath}: {name!r} duplicates another tensor that also maps to {c!r}")
        state[c] = t
    return state


def check_for_target(raw: dict, cfg, target, *, where: str, allow_mismatch: bool) -> str | None:
    """With a target: the fingerprint config.json records (`eyas_target`) checked against the target's (the warning
    when `allow_mismatch` lets a mismatch through, else None), and the drafter's vocab and width against the
    target's. Without one: None."""
    if target is None:
        return None
    mismatch = check_target(raw["eyas_target"], target.fingerprint, where=where,
                            allow_mismatch=allow_mismatch) if raw.get("eyas_target") else None
    if cfg.vocab_size != target.vocab_size or cfg.target_hidden_size != target.hidden_size:
        raise EyasError(f"{where}: drafter is for vocab {cfg.vocab_size} / hidden {cfg.target_hidden_size}, the "
                        f"target has {target.vocab_size} / {target.hidden_size}")
    return mismatch


def hf_shape(raw: dict, *, max_positions: int) -> dict:
    """DecoderShape's fields (model/shape.py) from an exported or published drafter's config.json, as the engines
    default them (`max_positions` where it names none). Raises KeyError for a missing size."""
    h, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    theta, scaling = target_rope(raw)
    return dict(hidden_size=h, target_hidden_size=int(raw.get("target_hidden_size") or h),
                intermediate_size=int(raw["intermediate_size"]), num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or h // heads), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", max_positions)),
                vocab_size=int(raw["vocab_size"]))


def imported_meta(fmt: str, path: Path, aux_layer_ids, warnings: list[str], raw: dict, mismatch: str | None) -> dict:
    """An importer's meta: {"format", "source", "aux_layer_ids", "warnings", "target" (the fingerprint config.json
    records, if any)}, after an allowed mismatch as accept_mismatch leaves it."""
    meta: dict[str, Any] = {"format": fmt, "source": str(path), "aux_layer_ids": list(aux_layer_ids),
                            "warnings": warnings}
    if raw.get("eyas_target"):
        meta["target"] = raw["eyas_target"]
    return accept_mismatch(meta, mismatch)


def load_weights(wpath, state: dict, want: dict, also: tuple[str, ...] = ()) -> None:
    """Copy a checkpoint's tensors `state` into the drafter's `want` (its state dict), refusing first any that do not
    fill it exactly (names, shapes, floating point), naming each difference; `also`: names allowed beside them (read
    separately)."""
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want) - set(also))
    shape = [f"{k} {tuple(state[k].shape)} (expected {tuple(want[k].shape)})"
             for k in want if k in state and state[k].shape != want[k].shape]
    if missing or extra or shape:
        parts = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else "",
                 f"wrong shape {shape}" if shape else ""]
        raise EyasError(f"{wpath}: weights do not match config.json: " + "; ".join(p for p in parts if p))
    not_float = [k for k in want if not state[k].is_floating_point()]
    if not_float:
        raise EyasError(f"{wpath}: tensors {not_float} are not floating point")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(state[k].to(v.dtype))


def load_eagle3_checkpoint(path: str | os.PathLike, *, target=None,
                           allow_target_mismatch: bool = False) -> tuple[Any, dict]:
    """A published / exported EAGLE-3 dir -> (Eagle3Drafter fp32, meta).

    meta: {"format": "eagle3", "source", "aux_layer_ids", "warnings", "target" (fingerprint, if recorded)}.
    """
    path = Path(path)
    raw = read_json(path / "config.json", absent=f"missing (is {path} an EAGLE-3 checkpoint directory?)")
    where = str(path / "config.json")
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise EyasError(f"{where}: architecture {arch!r} is not an EAGLE-3 Llama drafter (expected one of {ARCHITECTURES})")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise EyasError(f"{where}: num_hidden_layers {raw['num_hidden_layers']}, eyas drafters have exactly 1")
    warnings: list[str] = []
    n_layers = target.num_layers if target is not None else None
    arch = model_type = None
    if target is not None:
        arch = (getattr(target.config, "architectures", None) or [None])[0]
        model_type = getattr(target.config, "model_type", None)
    ids = resolve_layer_ids(raw, num_target_layers=n_layers, where=where, warnings=warnings, arch=arch,
                            model_type=model_type)
    cfg = drafter_config_from_hf(raw, aux_layer_ids=ids, where=where)
    mismatch = check_for_target(raw, cfg, target, where=where, allow_mismatch=allow_target_mismatch)

    wpath, tensors = _read_weights(path)
    state = named_state(wpath, tensors, canonical_name, warnings, ignore=lambda c: "embed_tokens" in c,
                        why="eyas uses the frozen target embedding")
    drafter = Eagle3Drafter(cfg)
    want = {k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    load_weights(wpath, state, want, also=("d2t", "t2d"))

    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise EyasError(f"{wpath}: missing 'd2t' (needed: draft vocab {cfg.draft_vocab_size} < vocab {cfg.vocab_size})")
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.is_floating_point():
        raise EyasError(f"{wpath}: d2t is {d2t.dtype} {tuple(d2t.shape)}, expected integer ({cfg.draft_vocab_size},)")
    t2d = check_vocab_maps(d2t, t2d, vocab_size=cfg.vocab_size, where=str(wpath))
    drafter.set_vocab(d2t.to(torch.int64), t2d)
    return drafter, imported_meta("eagle3", path, ids, warnings, raw, mismatch)


def accept_mismatch(meta: dict, warning: str | None) -> dict:
    """After an allowed target mismatch: the recorded fingerprint moves to "trained_target", so that later
    checks of meta["target"] see none, and the warning is kept in "target_mismatch" (and "warnings")."""
    if warning is None:
        return meta
    out = {k: v for k, v in meta.items() if k != "target"}
    out.update(target_mismatch=warning, trained_target=meta["target"], warnings=[*meta.get("warnings", []), warning])
    return out
