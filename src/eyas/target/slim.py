"""A target's weightless copy: config, tokenizer (and its code), the weight index, and only the shards that hold the
embedding, the final norm and the LM head: what every stage but the target's forward reads (docs/engines.md, step 0).

The copy keeps the weight index whole (its map names shards the copy lacks), so the target's fingerprint, which
hashes that map and the head tensors' bytes (target/fingerprint.py head_identity), is the full checkpoint's."""

from __future__ import annotations

import shutil
from pathlib import Path

from eyas.errors import EyasError
from eyas.target.meta import INDEX, head_weights, open_heads, read_json

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Weight files: copied only when they hold a head tensor (safetensors); the other formats never."""


def slim_copy(src: str | Path, dst: str | Path) -> dict:
    """Write DST as SRC's weightless copy -> {"files", "bytes", "head_shards"}. Refuses an existing non-empty DST and
    a SRC without a safetensors index; writes DST.partial first and renames it, so an interrupted copy leaves no DST.
    The copy's fingerprint weights are checked to equal SRC's."""
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise EyasError(f"{src}: no config.json (expected a model directory)")
    if not (src / INDEX).is_file():
        raise EyasError(f"{src}: no {INDEX}; a single-file checkpoint is its own copy (nothing to leave out)")
    if dst.exists() and any(dst.iterdir()):
        raise EyasError(f"{dst}: exists and is not empty")
    _, heads, _ = open_heads(src, read_json(src / "config.json"))
    shards = sorted({Path(h["path"]).name for h in heads.values()})
    part = dst.with_name(dst.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    files, size = 0, 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_dir() or (p.suffix in WEIGHT_SUFFIXES and p.name not in shards):
            continue
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, part / rel)
        files, size = files + 1, size + p.stat().st_size
    if head_weights(part) != head_weights(src):
        shutil.rmtree(part, ignore_errors=True)
        raise EyasError(f"{dst}: the copy's head tensors do not hash like {src}'s (a shard changed while copying?)")
    if dst.exists():
        dst.rmdir()
    part.rename(dst)
    return {"files": files, "bytes": size, "head_shards": shards}
