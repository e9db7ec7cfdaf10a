"""decode/ imports one way: its modules import each other at the top only, and those imports form no cycle.

A cycle (spec -> round -> spec) or an import hidden inside a function to dodge one would fail here; so would a
module that cannot be imported on its own.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import eyas.decode

PKG = Path(eyas.decode.__file__).parent
MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


def decode_imports(node) -> set[str]:
    """The decode/ modules an import statement names (`from eyas.decode import x`, `from eyas.decode.x import y`)."""
    if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        return set()
    return {n.split(".")[2] for n in names if n.startswith("eyas.decode.") and n.split(".")[2] in MODULES}


def graph() -> tuple[dict[str, set[str]], list[str]]:
    """-> (module -> decode/ modules it imports at the top, imports of decode/ modules found below the top level)."""
    edges, nested = {}, []
    for m in MODULES:
        tree = ast.parse((PKG / f"{m}.py").read_text())
        top = set(map(id, tree.body))
        edges[m] = set()
        for node in ast.walk(tree):
            deps = decode_imports(node)
            if deps and id(node) not in top:
                nested.append(f"{m}.py:{node.lineno} imports {sorted(deps)} below the top level")
            edges[m] |= deps
    return edges, nested


def test_no_import_cycles_and_no_nested_imports():
    edges, nested = graph()
    assert not nested, nested
    assert sum(map(len, edges.values())) >= 5  # the package's modules do import each other: not vacuous
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        path.append(m)
        for d in sorted(edges[m]):
            visit(d)
        path.pop()
        done.add(m)
    for m in MODULES:
        visit(m)


def test_a_cycle_is_detected(monkeypatch):
    """The check above fails on a cycle (round importing spec back, as decode/ once did)."""
    edges, _ = graph()
    edges["round"] = edges["round"] | {"spec"}
    monkeypatch.setattr(sys.modules[__name__], "graph", lambda: (edges, []))
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycles_and_no_nested_imports()


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_on_its_own(module):
    """A fresh interpreter imports the module first (an import circle shows up as an ImportError here)."""
    src = str(Path(eyas.decode.__file__).parents[2])
    subprocess.run([sys.executable, "-c", f"import eyas.decode.{module}"], check=True, cwd=src,
                   env={**os.environ, "PYTHONPATH": src})
