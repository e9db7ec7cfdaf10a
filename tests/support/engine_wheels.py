"""Obtain the SGLang and vLLM loader sources the export contract is checked against.

`pip download --no-deps` the pinned wheels (eyas.export.engine_pins.ENGINE_VERSIONS) into a cache
($EYAS_ENGINE_CACHE or ~/.cache/eyas/engine-wheels), extract only the .py files listed in FILES,
and the wheel's METADATA (its requirements), and delete the wheel (vLLM's is ~340 MB); later runs use the extracted
files and need no network.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from eyas.export.engine_pins import ENGINE_VERSIONS

FILES = {
    "sglang": ["sglang/srt/models/llama_eagle3.py", "sglang/srt/models/llama.py",
               "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py",
               "sglang/srt/models/deepseek_v2.py", "sglang/srt/speculative/eagle_worker_v2.py",
               # DFlash: the draft model and the config parser its __init__ calls (tests/test_dflash_contract.py)
               "sglang/srt/models/dflash.py", "sglang/srt/speculative/dflash_utils.py"],
    "vllm": ["vllm/model_executor/models/llama_eagle3.py", "vllm/model_executor/models/llama.py",
             "vllm/model_executor/models/utils.py", "vllm/model_executor/models/registry.py",
             "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
             # DFlash: the draft model and the MLP it imports from qwen2 (tests/test_dflash_contract.py)
             "vllm/model_executor/models/qwen3_dflash.py", "vllm/model_executor/models/qwen2.py"],
}


class NoNetwork(RuntimeError):
    """PyPI is unreachable and the sources are not cached: the contract test skips."""


def cache_dir() -> Path:
    return Path(os.environ.get("EYAS_ENGINE_CACHE") or Path.home() / ".cache" / "eyas" / "engine-wheels")


def _online(host: str = "pypi.org") -> bool:
    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


def engine_source(engine: str) -> Path:
    """Directory holding the FILES of the pinned `engine` wheel (download + extract on first use)."""
    version = ENGINE_VERSIONS[engine]
    root = cache_dir() / f"{engine}-{version}"
    if all((root / f).exists() for f in FILES[engine]) and (root / "METADATA").exists():
        return root
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(wheels), f"{engine}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob(f"{engine}-{version}-*.whl"))
    if r.returncode != 0 or not found:
        if not _online():
            raise NoNetwork(f"PyPI unreachable and {engine}=={version} not cached in {root}")
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as z:
        names = set(z.namelist())
        missing = [f for f in FILES[engine] if f not in names]
        if missing:
            raise RuntimeError(f"{found[0].name} lacks {missing}: the engine moved its EAGLE-3 code; update FILES")
        for f in FILES[engine]:
            (tmp / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp / f).write_bytes(z.read(f))
        (tmp / "METADATA").write_bytes(z.read(f"{engine}-{version}.dist-info/METADATA"))
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    for w in found:
        w.unlink()
    return root


def engine_requirements(engine: str) -> list[str]:
    """The pinned `engine` wheel's Requires-Dist lines that apply to this platform without an extra."""
    reqs = []
    for line in (engine_source(engine) / "METADATA").read_text().splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                reqs.append(r)
    return reqs
