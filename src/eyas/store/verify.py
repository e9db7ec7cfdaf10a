"""`eyas store verify`: checksums, shapes, dtypes, offsets, finiteness of every shard; names the bad one."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from tqdm import tqdm

from eyas.errors import EyasError
from eyas.manifest import sha256_file
from eyas.store import format as fmt


def _check_shard(store, rec: dict) -> None:
    path = store.path / rec["file"]

    def bad(msg: str):
        raise EyasError(f"{path}: {msg}")

    if not path.exists():
        bad("missing")
    if path.stat().st_size != rec["bytes"]:
        bad(f"size {path.stat().st_size} != {rec['bytes']} recorded")
    if sha256_file(path) != rec["sha256"]:
        bad("sha256 mismatch: the shard is corrupted")
    h_size, dtype = store.hidden_size, store.store_dtype
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types
        bad(f"not a readable safetensors file ({e})")
    want = {"input_ids", "loss_mask", "offsets", "hidden"} | ({"scale"} if dtype == "fp8" else set())
    if set(t) != want:
        bad(f"tensors {sorted(t)}, expected {sorted(want)}")
    if json.loads(meta.get("ids", "[]")) != rec["ids"]:
        bad("sample ids in the shard differ from its record")
    S, N = rec["samples"], rec["tokens"]
    shapes = {"input_ids": (N,), "loss_mask": (N,), "offsets": (S + 1,), "hidden": (N, fmt.NUM_STATES, h_size),
              "scale": (N, fmt.NUM_STATES)}
    dtypes = {"input_ids": torch.int32, "loss_mask": torch.uint8, "offsets": torch.int64,
              "hidden": fmt.DTYPES[dtype], "scale": torch.float32}
    for k, v in t.items():
        if tuple(v.shape) != shapes[k] or v.dtype != dtypes[k]:
            bad(f"tensor {k} is {tuple(v.shape)} {v.dtype}, expected {shapes[k]} {dtypes[k]}")
    off = t["offsets"]
    if off[0] != 0 or off[-1] != N or bool((off[1:] <= off[:-1]).any()):
        bad("offsets are not strictly increasing from 0 to the token count")
    if t["loss_mask"].max() > 1:
        bad("loss_mask holds values other than 0/1")
    vocab = store.manifest.get("vocab_size")
    ids = t["input_ids"]
    if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
        bad(f"input ids outside [0, {vocab})")
    if "scale" in t and not (torch.isfinite(t["scale"]).all() and (t["scale"] > 0).all()):
        bad("fp8 scales not finite and positive")
    bad_rows = _nonfinite(t["hidden"]).flatten(1).any(1)                         # (N,)
    if bool(bad_rows.any()):
        bad(f"non-finite hidden state at token {int(bad_rows.nonzero()[0])}")


def _nonfinite(x: torch.Tensor) -> torch.Tensor:
    """NaN/inf test on the bit pattern (fast, and works for fp8, which has no isfinite on the CPU)."""
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16) & 0x7F80) == 0x7F80     # exponent all ones
    if x.dtype == torch.float8_e4m3fn:
        return (x.view(torch.uint8) & 0x7F) == 0x7F          # e4m3fn: only NaN, S.1111.111
    return ~torch.isfinite(x)


def verify_store(store, progress: bool = False) -> dict:
    """Check every committed shard of `store`; raise EyasError naming the first bad shard."""
    seen: dict[str, str] = {}
    for rec in tqdm(store.records, desc="verify", unit="shard", disable=not progress):
        for i in rec["ids"]:
            if i in seen:
                raise EyasError(f"{store.path / rec['file']}: sample {i!r} also in {seen[i]}")
            seen[i] = rec["file"]
        _check_shard(store, rec)
    return {"ok": True, "shards": len(store.records), "samples": len(seen), "tokens": store.num_tokens}
