"""Real SGLang model sources for tests: `pip download --no-deps sglang==X` into a cache, extract with zipfile.

Cache: $EYAS_ENGINE_CACHE or ~/.cache/eyas/engine-wheels. Versions: 0.5.14 (oldest with --forward-hooks)
and the newest on PyPI (EYAS_SGLANG_VERSIONS="0.5.14,0.5.23" overrides). Tests skip when nothing can
be downloaded (no PyPI access) and no wheel is cached.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

MODEL_FILES = ("llama.py", "qwen2.py", "qwen3.py", "deepseek_v2.py")


def cache_dir() -> Path:
    d = Path(os.environ.get("EYAS_ENGINE_CACHE", Path.home() / ".cache" / "eyas" / "engine-wheels"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _version_of(wheel: Path) -> tuple:
    v = wheel.name.split("-")[1]
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.]", v))


def wheel(version: str | None) -> Path | None:
    """The cached wheel of `version` (None = newest on PyPI), downloading it when missing."""
    d = cache_dir()
    pattern = f"sglang-{version}-*.whl" if version else "sglang-*.whl"
    if version:
        have = sorted(d.glob(pattern))
        if have:
            return have[0]
    spec = f"sglang=={version}" if version else "sglang"
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(d), spec],
                       check=True, capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError):
        pass
    have = sorted(d.glob(pattern), key=_version_of)
    return have[-1] if have else None


def versions() -> list[str | None]:
    env = os.environ.get("EYAS_SGLANG_VERSIONS")
    return [v.strip() for v in env.split(",")] if env else ["0.5.14", None]


def extract_models(whl: Path, dest: Path) -> Path:
    """Extract sglang/srt/models/{llama,qwen2,qwen3,deepseek_v2}.py -> dest/sglang; returns the package dir."""
    with zipfile.ZipFile(whl) as z:
        for name in MODEL_FILES:
            member = f"sglang/srt/models/{name}"
            out = dest / member
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(member))
    return dest / "sglang"


def read_member(whl: Path, member: str) -> str | None:
    """The text of one file of the wheel, or None when this version has no such file."""
    with zipfile.ZipFile(whl) as z:
        try:
            return z.read(member).decode()
        except KeyError:
            return None
