"""eyas's packages import one way (docs/architecture.md, "Layers"), read from the source with `ast`.

Every `eyas` import counts, at the module top or inside a function (not those under `if TYPE_CHECKING:`, which
never run): a function-level import hides a cycle as well as a top-level one does. The checks: no import from a
lower layer to a higher one, no cycle between modules, no cycle between packages, and no function-level eyas import
but those DEFERRED says why.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "eyas"

LAYERS = [
    ("eyas", "errors"),               # the package itself (its version) and the error type
    ("sdpa", "serving"),              # attention kernels; the HTTP client of serving engines
    ("target",),                      # loading and running the target model
    ("knobs", "manifest", "warmup"),  # user-facing knobs; manifests and atomic writes; warm-up processes
    ("model",),                       # the drafters
    ("data",),                        # conversations -> prepared/
    ("store",),                       # the hidden-state store
    ("engines",),                     # capture through a serving engine (used by capture)
    ("capture",),                     # prepared/ -> store/
    ("train",),                       # store/ or online -> drafter
    ("decode",),                      # speculative decoding
    ("bench",),                       # timed decoding (decode/) of a trained drafter (train/ for its config)
    ("export",),                      # drafter -> engine checkpoint
    ("report",),
    ("recipes",),
    ("run", "sizing"),                # `eyas run`: every stage in order; its sizing to a time budget
    ("cli", "__main__"),
]
LAYER = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}

_CHILD = ("the warm-up child imports it and starts watch_parent before torch loads, so that a parent killed meanwhile "
          "is seen (tests/test_bench_prewarm.py, test_the_warm_up_process_exits_when_its_parent_dies)")
_SERVER = ("runs inside the SGLang server, whose environment may lack eyas's dependencies: the hook's module imports "
           "light, and these load only where the hook runs (tests/test_install_beside_engines.py)")
DEFERRED: dict[tuple[str, str], str] = {
    **{("eyas.warmup", t): _CHILD for t in ("eyas.target.fingerprint", "eyas.target.load")},
    **{("eyas.bench.prewarm", t): _CHILD for t in ("eyas.bench.bench", "eyas.manifest", "eyas.model.checkpoint",
                                                   "eyas.model.dflash", "eyas.model.drafter", "eyas.target",
                                                   "eyas.train.setup")},
    **{("eyas.train.prewarm", t): _CHILD for t in ("eyas.data.prepared", "eyas.manifest", "eyas.target",
                                                   "eyas.target.compile", "eyas.train.config", "eyas.train.data",
                                                   "eyas.train.trainer")},
    **{("eyas.engines.sglang_hook", t): _SERVER for t in ("eyas.data.prepared", "eyas.engines.served_check",
                                                          "eyas.manifest", "eyas.store.format", "eyas.store.lock",
                                                          "eyas.store.writer")},
    ("eyas.engines.locking", "eyas.store.writer"): _SERVER + "; the hook imports engines/locking.py at its top",
}
"""(module, eyas module) -> why that module imports it inside a function rather than at its top."""



def modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of src/eyas (a package by its __init__.py)."""
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = modules()


def resolve(name: str) -> str | None:
    """The module a dotted name lies in (`eyas.target.load_target` -> `eyas.target`), or None outside eyas."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def type_checking(node) -> bool:
    """`if TYPE_CHECKING:`: imports for annotations only, which never run."""
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def module_top(tree: ast.Module) -> set[int]:
    """ids of the nodes that run at import time: the module's statements, also inside a top-level if/try."""
    top = set()
    for node in tree.body:
        top.add(id(node))
        if isinstance(node, (ast.If, ast.Try)):
            top.update(map(id, ast.walk(node)))
    return top


def skipped(tree: ast.Module) -> set[int]:
    """ids of the nodes under an `if TYPE_CHECKING:`."""
    return {id(n) for node in ast.walk(tree) if type_checking(node) for n in ast.walk(node)}


def module_imports(mod: str, source: str, is_package: bool = False) -> list[tuple[str, int, str, bool]]:
    """The eyas imports of one module's source: (module, line, imported eyas module, at the module top)."""
    out = []
    tree = ast.parse(source)
    top, types_only = module_top(tree), skipped(tree)
    package = mod.split(".") if is_package else mod.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in types_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for target in sorted({resolve(n) for n in names} - {None, mod}):
            if target.split(".")[0] == "eyas":
                out.append((mod, node.lineno, target, id(node) in top))
    return out


def imports() -> list[tuple[str, int, str, bool]]:
    """Every eyas import of src/eyas."""
    return [i for mod, path in MODULES.items()
            for i in module_imports(mod, path.read_text(), path.name == "__init__.py")]


def package(mod: str) -> str:
    """The layer unit of a module: its package below eyas (`eyas.target.load` -> target), or the module itself."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "eyas"


def cycles(edges: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def module_graph(found) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod, _, target, _ in found:
        edges.setdefault(mod, set()).add(target)
    return edges


def package_graph(found) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod, _, target, _ in found:
        if package(mod) != package(target):
            edges.setdefault(package(mod), set()).add(package(target))
    return edges


FOUND = imports()


def test_every_package_has_a_layer():
    assert not {package(m) for m in MODULES} - set(LAYER), "add the new package to LAYERS (and docs/architecture.md)"
    assert len(FOUND) > 300  # the walk sees eyas's imports: not vacuous


def test_imports_go_down():
    lines = [f"{m}:{n} imports {t} from a higher layer" for m, n, t, _ in FOUND
             if LAYER[package(m)] < LAYER[package(t)]]
    assert not lines, "\n".join(lines)


def test_no_module_cycles():
    found = cycles(module_graph(FOUND))
    assert not found, [sorted(c) for c in found]


def test_no_package_cycles():
    found = cycles(package_graph(FOUND))
    assert not found, [sorted(c) for c in found]


def test_function_level_imports_only_where_deferred():
    nested = {(m, t) for m, _, t, top in FOUND if not top}
    allowed = set(DEFERRED)
    lines = [f"{m}:{n} imports {t} inside a function: move it to the top (or add it to DEFERRED with the reason)"
             for m, n, t, top in FOUND if not top and (m, t) not in allowed]
    assert not lines, "\n".join(lines)
    assert not allowed - nested, f"now at the top: remove {sorted(allowed - nested)}"


def test_the_checks_see_violations():
    """A cycle, an upward import and a nested import made up here are each found."""
    fake = [("eyas.target.load", 1, "eyas.target.meta", True), ("eyas.target.meta", 2, "eyas.target.load", False),
            ("eyas.knobs", 3, "eyas.bench.bench", True)]
    assert frozenset({"eyas.target.load", "eyas.target.meta"}) in cycles(module_graph(fake))
    assert frozenset({"target", "knobs", "bench"}) not in cycles(package_graph(fake))
    back = ("eyas.bench.bench", 4, "eyas.knobs", True)
    assert cycles(package_graph(fake + [back])) == [frozenset({"knobs", "bench"})]
    assert LAYER[package("eyas.knobs")] < LAYER[package("eyas.bench.bench")]
    assert resolve("eyas.target.load_target") == "eyas.target" and resolve("torch.nn") is None
    source = ("from typing import TYPE_CHECKING\nimport eyas.errors\nif TYPE_CHECKING:\n"
              "    from eyas.bench import bench\ndef f():\n    from . import load\n"
              "    from eyas.target.meta import read_json\n")
    assert module_imports("eyas.target.runner", source) == [
        ("eyas.target.runner", 2, "eyas.errors", True), ("eyas.target.runner", 6, "eyas.target.load", False),
        ("eyas.target.runner", 7, "eyas.target.meta", False)]


@pytest.mark.parametrize("entry", sorted(DEFERRED.items()))
def test_each_listed_entry_says_why(entry):
    assert len(entry[1]) > 15
