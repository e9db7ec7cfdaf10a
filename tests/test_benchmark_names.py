"""Running `python benchmarks/X.py` puts benchmarks/ first on sys.path, and tests that import a benchmark do the
same: a script named like an installed module would shadow it for every library that imports it (transformers
5.25 imports the `kernels` package; a benchmarks/kernels.py broke every test that loaded a model)."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_script_shadows_an_importable_module(monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != BENCH])
    stems = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "levers" in stems   # the glob found the scripts
    clashes = []
    for stem in stems:
        if stem in sys.modules and Path(getattr(sys.modules[stem], "__file__", "") or "").parent == BENCH:
            continue   # a benchmark another test imported: not an installed module
        if stem in sys.builtin_module_names or importlib.util.find_spec(stem) is not None:
            clashes.append(stem)
    assert clashes == []
