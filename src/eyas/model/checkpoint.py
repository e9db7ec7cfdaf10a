"""A drafter on disk: the one opener (`open_drafter`) and eyas's own save/load.

`open_drafter` accepts, and finds the drafter in:
    RUN/                 an `eyas run` dir             -> RUN/train/drafter
    TRAIN/               an `eyas train` run dir       -> TRAIN/drafter
    DIR/                 an eyas drafter dir           (config.json + model.safetensors, save_drafter)
    EXPORT/ or HEAD/     an `eyas export` dir or a published EAGLE-3 head (eyas.model.importer), or the same
                         of a DFlash drafter (eyas.model.dflash_import: architectures ["DFlashDraftModel"])
An eyas drafter dir holds either kind: config.json's "kind" is "dflash" for a DFlash drafter (model/dflash.py) and
absent for EAGLE-3.
With a target, the drafter's recorded target fingerprint is checked here, once.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.manifest import atomic_write_bytes, check_target
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.model.dflash_import import is_dflash_dir, load_dflash_checkpoint
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.model.importer import accept_mismatch, load_eagle3_checkpoint
from eyas.target.meta import read_json

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def save_drafter(drafter: Eagle3Drafter | DFlashDrafter, path: str | os.PathLike, meta: dict[str, Any] | None = None) -> None:
    """Write DIR/config.json (config + meta, e.g. {"target": fingerprint}) and DIR/model.safetensors (fp32)."""
    from safetensors.torch import save

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in drafter.state_dict().items()}
    atomic_write_bytes(path / WEIGHTS_FILE, save(state))
    cfg = drafter.config.to_dict()
    clash = sorted(set(meta or {}) & set(cfg))
    if clash:
        raise ValueError(f"save_drafter: meta keys {clash} clash with config fields")
    atomic_write_bytes(path / CONFIG_FILE, (json.dumps({**cfg, **(meta or {})}, indent=2) + "\n").encode())


def load_drafter(path: str | os.PathLike, *, device="cpu") -> tuple[Eagle3Drafter | DFlashDrafter, dict]:
    """Read a directory written by save_drafter -> (drafter in fp32, meta: the non-config keys of config.json)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path, w_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    absent = f"missing (is {path} a drafter checkpoint directory?)"
    raw = read_json(cfg_path, absent=absent)
    if not w_path.exists():
        raise EyasError(f"{w_path}: {absent}")
    config_cls, model_cls = (DFlashConfig, DFlashDrafter) if raw.get("kind") == "dflash" else (DrafterConfig,
                                                                                              Eagle3Drafter)
    known = {f.name for f in fields(config_cls)}
    try:
        cfg = config_cls.from_dict({k: v for k, v in raw.items() if k in known})
    except (TypeError, ValueError) as e:
        raise EyasError(f"{cfg_path}: bad drafter config ({e})") from e
    meta = {k: v for k, v in raw.items() if k not in known and k != "kind"}
    drafter = model_cls(cfg)
    try:
        state = load_file(str(w_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ... on a damaged file
        why = " ".join(str(e).split())  # one line
        raise EyasError(f"{w_path}: not a readable safetensors file ({type(e).__name__}: {why})") from e
    want = drafter.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    bad = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    if missing or extra or bad:
        raise EyasError(f"{w_path}: weights do not match config (missing {missing}, unexpected {extra}, "
                        f"wrong shape {bad})")
    drafter.load_state_dict(state)
    return drafter.to(device), meta


def is_eyas_drafter_dir(path: Path) -> bool:
    """config.json written by save_drafter (eyas field names, no HF `architectures`)."""
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and "aux_layer_ids" in raw and "architectures" not in raw


def drafter_dir(path: str | os.PathLike) -> Path:
    """The directory holding the drafter's config.json for any accepted layout (see the module docstring)."""
    p = Path(path)
    for d in (p / "train" / "drafter", p / "drafter", p):
        if (d / CONFIG_FILE).is_file():
            return d
    raise EyasError(f"{p}: not a drafter: expected an eyas run dir (train/drafter/), a train run dir (drafter/), "
                    f"a drafter dir or an exported/published EAGLE-3 or DFlash dir (config.json + weights)")


KINDS = ("eagle3", "dflash")


def drafter_kind(p: Path) -> str:
    """"dflash" or "eagle3" for a directory drafter_dir found, from its config.json alone (no weights read)."""
    if is_eyas_drafter_dir(p):
        return "dflash" if json.loads((p / CONFIG_FILE).read_text()).get("kind") == "dflash" else "eagle3"
    return "dflash" if is_dflash_dir(p) else "eagle3"


def check_kind(found: str, expected: str | None, where: Path) -> None:
    """Refuse a drafter of another kind than the caller can use, naming both."""
    if expected is not None and found != expected:
        names = {"eagle3": "an EAGLE-3 drafter", "dflash": "a DFlash drafter"}
        raise EyasError(f"{where}: {names[found]} where {names[expected]} was expected")


def open_drafter(path: str | os.PathLike, target=None, *, allow_target_mismatch: bool = False,
                 kind: str | None = None) -> tuple[Eagle3Drafter | DFlashDrafter, dict]:
    """Any accepted layout -> (drafter in fp32 on the CPU, meta).

    meta: {"format": "eyas" | "eagle3" | "dflash", "source", "aux_layer_ids", "warnings", "target" (the recorded
    fingerprint)}. With `target`, a drafter whose recorded fingerprint differs is refused, naming each field; with
    `allow_target_mismatch` it is loaded and meta["target_mismatch"] holds the warning (the fingerprint moves to
    meta["trained_target"]). `kind` ("eagle3" | "dflash"): refuse a drafter of the other kind before reading weights.
    """
    if kind not in (None, *KINDS):
        raise ValueError(f"open_drafter: kind {kind!r}, expected one of {KINDS} or None")
    p = drafter_dir(path)
    check_kind(drafter_kind(p), kind, p)
    if not is_eyas_drafter_dir(p):
        if is_dflash_dir(p):
            return load_dflash_checkpoint(p, target=target, allow_target_mismatch=allow_target_mismatch)
        return load_eagle3_checkpoint(p, target=target, allow_target_mismatch=allow_target_mismatch)
    drafter, meta = load_drafter(p)
    meta = {"format": "eyas", "source": str(p), "aux_layer_ids": list(drafter.config.aux_layer_ids),
            "warnings": [], **meta}
    mismatch = None
    if target is not None and meta.get("target"):
        mismatch = check_target(meta["target"], target.fingerprint, where=str(p / CONFIG_FILE),
                                allow_mismatch=allow_target_mismatch)
    return drafter, accept_mismatch(meta, mismatch)
