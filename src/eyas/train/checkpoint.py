"""Resumable checkpoints: RUN/checkpoints/step-N/ holding everything needed to continue bit-for-bit.

  step-N/state.pt         model (full state dict), optimizer, scheduler, step, data position, config identity
  step-N/rng-rRRR.pt      each rank's RNG states (python, torch CPU, CUDA)
Both are read with torch.load(weights_only=True), so they hold only tensors and plain Python types
(dict, list, tuple, str, int, float, bool, None): a pickle planted in a checkpoint is refused, never run.
The directory is assembled as `.step-N.tmp` and renamed into place, so a `step-N` that exists is complete.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.manifest import fsync_dir

STEP_RE = re.compile(r"^step-(\d+)$")
VERSION = 2
"""The layout of a training run's manifest.json and checkpoints (their config identity: every TrainConfig field
but RESUME_FREE); a --resume refuses a run of another version (train/setup.py refuse_run_dir)."""


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir) -> list[tuple[int, Path]]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in d.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def latest_checkpoint(run_dir) -> Path | None:
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None


def rng_state() -> dict:
    st = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(run_dir, step: int, state: dict | None, *, rank: int = 0, barrier=lambda: None,
                    keep: int = 2) -> Path:
    """Write step-N atomically. Every rank calls it (state only needed on rank 0); `barrier` syncs ranks."""
    root = checkpoint_dir(run_dir)
    tmp, final = root / f".step-{step}.tmp", root / f"step-{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    _save(rng_state(), tmp / f"rng-r{rank:03d}.pt")
    if rank == 0:
        _save(state, tmp / "state.pt")
    barrier()
    if rank == 0:
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: Path, *, rank: int = 0) -> tuple[dict, dict]:
    """(state, this rank's RNG state) of a step-N directory."""
    path = Path(path)
    files = (path / "state.pt", path / f"rng-r{rank:03d}.pt")
    for f in files:
        if not f.exists():
            raise EyasError(f"{f}: missing from checkpoint {path} (written by a run with fewer ranks?)")
    out = []
    for f in files:
        try:  # weights_only: tensors and plain containers only; any other pickle is refused without running it
            with warnings.catch_warnings():  # a foreign pickle protocol warns before being refused
                warnings.simplefilter("ignore")
                out.append(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - torch.load raises many types on a damaged or hostile file
            why = ("a pickle that holds more than tensors and plain types; refused without running it"
                   if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e) else " ".join(str(e).split()))
            raise EyasError(f"{f}: unreadable checkpoint file ({type(e).__name__}: {why})") from e
        if not isinstance(out[-1], dict):
            raise EyasError(f"{f}: holds a {type(out[-1]).__name__}, expected a dict")
    state, rng = out
    return state, rng
