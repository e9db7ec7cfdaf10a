"""eyas installs into the serving engines' environments: the capture hook runs inside the SGLang server's Python,
so eyas's own requirements must admit the engines' pins (SGLang 0.5.23 pins torch 2.14.1, vLLM 0.33.0 torch 2.14.0),
and the hook must import with only what those environments are sure to have.

The engines' requirements are read from the pinned wheels' METADATA (tests/engine_wheels.py, cached beside the
loader sources the export contract reads)."""

import json
import subprocess
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from support import engine_wheels

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("sglang", "vllm")


def _eyas_requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {canonicalize_name(r.name): r for r in reqs if r.marker is None or r.marker.evaluate()}


def _engine_pins(engine: str) -> list[Requirement]:
    """The engine's requirements on packages eyas also requires."""
    try:
        reqs = engine_wheels.engine_requirements(engine)
    except engine_wheels.NoNetwork as e:
        pytest.skip(f"no network: {e}")
    ours = _eyas_requirements()
    return [r for r in reqs if canonicalize_name(r.name) in ours]


@pytest.mark.parametrize("engine", ENGINES)
def test_exact_pins_admitted(engine):
    """Every version an engine pins exactly (torch, transformers, tokenizers) satisfies eyas's bound on it."""
    ours = _eyas_requirements()
    pinned = 0
    for r in _engine_pins(engine):
        for spec in r.specifier:
            if spec.operator == "==":
                pinned += 1
                mine = ours[canonicalize_name(r.name)].specifier
                assert mine.contains(spec.version, prereleases=True), \
                    f"eyas requires {r.name}{mine}, which excludes {engine}'s pin {r.name}=={spec.version}"
    assert pinned >= 1, f"{engine} pins none of eyas's requirements exactly: the check checked nothing"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_resolves_with_engine(engine, tmp_path):
    """pip's resolver (a dry run, metadata only) installs eyas together with the engine's pins of the packages both
    require: a cap that excludes the engine's torch or transformers fails here."""
    pins = [str(r) for r in _engine_pins(engine)]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--disable-pip-version-check", "--report", str(report), str(ROOT), *pins]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"eyas does not resolve beside {engine} ({' '.join(pins)}):\n{r.stderr[-3000:]}"
    chosen = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    for p in _engine_pins(engine):
        assert p.specifier.contains(chosen[canonicalize_name(p.name)], prereleases=True), (p, chosen)


HEAVY = ("transformers", "tokenizers", "gguf", "accelerate", "matplotlib", "tensorboard", "httpx", "jinja2")
"""eyas's requirements that the capture hook must not import: it runs inside the server, where eyas may be
installed without its dependencies (docs/engines.md, step 0)."""


@pytest.mark.parametrize("module", ["eyas.engines.sglang_hook"])
def test_hook_imports_without_heavy_dependencies(module):
    """The hook module imports with every heavy requirement made unimportable, and imports none of them."""
    code = f"""
import importlib.abc, sys
HEAVY = {HEAVY!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"blocked: {{name}}")
        return None
sys.meta_path.insert(0, Block())
import {module}
print(sorted(m for m in sys.modules if m.split(".")[0] in HEAVY))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout
