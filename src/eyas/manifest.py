"""manifest.json for every stage's output directory: atomic writes, schema checks, fingerprints.

Every stage writes `DIR/manifest.json` with at least:
  {"schema": SCHEMA_VERSION, "kind": "<stage>", "config": {...resolved config...},
   "target": {...target fingerprint...}, ...stage-specific counts and checksums...}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.target.fingerprint import diffs
from eyas.target.meta import read_json

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise EyasError(f"{path}: could not write ({e.strerror or e})") from e
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(out_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    manifest = {"schema": SCHEMA_VERSION, **manifest}
    atomic_write_bytes(Path(out_dir) / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode())


def read_manifest(out_dir: str | os.PathLike, kind: str | None = None) -> dict[str, Any]:
    """Read and check DIR/manifest.json; `kind` is the stage that must have written it."""
    path = Path(out_dir) / MANIFEST
    manifest = read_json(path, absent=f"no manifest (is {out_dir} an eyas {kind or 'output'} directory?)")
    if manifest.get("schema") != SCHEMA_VERSION:
        raise EyasError(f"{path}: schema {manifest.get('schema')!r}, this eyas reads schema {SCHEMA_VERSION}")
    if kind is not None and manifest.get("kind") != kind:
        raise EyasError(f"{path}: is a {manifest.get('kind')!r} directory, expected {kind!r}")
    return manifest


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_fingerprint(d) -> bool:
    """A target fingerprint (target/fingerprint.py), also an older eyas's (version 1: {"identity", "config_sha256",
    ...}), which the comparison refuses in one line."""
    return isinstance(d, dict) and ("fingerprint" in d or "config_sha256" in d)


def _short(v):
    return f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else v


def fingerprint_diffs(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    """What makes two target fingerprints differ, by field (target/fingerprint.py `diffs`)."""
    return diffs(expected, actual, prefix)


def diff_dicts(expected: dict, actual: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two (nested) dicts, e.g. ['layers: 2,15,27 != 2,15,28'].
    Target fingerprints inside are compared as fingerprints (`fingerprint_diffs`)."""
    if is_fingerprint(expected) and is_fingerprint(actual):
        return fingerprint_diffs(expected, actual, prefix)
    return _diff_fields(expected, actual, prefix)


def _diff_fields(expected: dict, actual: dict, prefix: str) -> list[str]:
    out = []
    for key in sorted(set(expected) | set(actual)):
        a, b = expected.get(key, "<missing>"), actual.get(key, "<missing>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_dicts(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {_short(a)!r} != {_short(b)!r}")
    return out


def check_same(expected: dict, actual: dict, *, what: str, where: str) -> None:
    """Refuse with a message naming each field that differs."""
    diffs = diff_dicts(expected, actual)
    if diffs:
        raise EyasError(f"{where}: {what} does not match (" + "; ".join(diffs) + ")")


def check_target(recorded: dict, target_fingerprint: dict, *, what: str = "target", where: str,
                 allow_mismatch: bool = False) -> str | None:
    """Compare a recorded target fingerprint with the loaded target's. A mismatch raises, naming each field,
    or with `allow_mismatch` (--allow-target-mismatch) returns the warning to record (and logs it)."""
    diffs = diff_dicts(recorded, target_fingerprint)
    if not diffs:
        return None
    msg = f"{where}: {what} does not match (" + "; ".join(diffs) + ")"
    if not allow_mismatch:
        raise EyasError(msg + "; --allow-target-mismatch uses it anyway")
    warning = msg + "; used anyway (--allow-target-mismatch)"
    log.warning(warning)
    return warning
