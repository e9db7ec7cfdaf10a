"""The benchmarks are one package, run as `python -m benchmarks.NAME` from the repository root, and tests import
them as `benchmarks.NAME`: nothing puts benchmarks/ itself on sys.path, where a script named like an installed
module would shadow it for every library that imports it (transformers 5.25 imports the `kernels` package; a
benchmarks/kernels.py on the path breaks every test that loads a model)."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def test_no_benchmark_script_shadows_an_importable_module(monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != BENCH])
    stems = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "regen" in stems   # the glob found the scripts
    clashes = []
    for stem in stems:
        if stem in sys.modules and Path(getattr(sys.modules[stem], "__file__", "") or "").parent == BENCH:
            continue   # a benchmark another test imported: not an installed module
        if stem in sys.builtin_module_names or importlib.util.find_spec(stem) is not None:
            clashes.append(stem)
    assert clashes == []


def test_benchmarks_is_the_repository_package_and_nothing_edits_sys_path():
    spec = importlib.util.find_spec("benchmarks")
    assert spec is not None and Path(spec.origin).resolve() == BENCH / "__init__.py"
    assert (BENCH / "gpu" / "__init__.py").exists()
    edits = [str(p.relative_to(ROOT)) for d in (BENCH, ROOT / "tests") for p in d.rglob("*.py")
             if "benchmarks" in p.read_text() and re.search(r"sys\.path\.(insert|append)|sys\.path\[", p.read_text())
             and p.name != Path(__file__).name]
    assert edits == []
