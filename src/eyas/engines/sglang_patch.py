"""Source patcher for SGLang releases without --forward-hooks: `eyas engine patch sglang --check|--apply|--revert`.

Each insertion point is found by parsing the file with `ast`: a class, a method of it, and a statement
at the top level of that method's body (here `self.logits_processor = ...` in the causal LM's
__init__). A missing or ambiguous point is refused. The inserted block is fenced by marker comments,
so applying twice equals applying once; the original bytes are kept in FILE.eyas-orig and --revert
writes them back exactly. The block calls eyas.engines.sglang_hook.attach(self), which registers the
same capture hook that --forward-hooks would (configured by $EYAS_SGLANG_HOOK; a no-op when unset).
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError

BEGIN = "# >>> eyas-capture v1 (inserted by `eyas engine patch sglang`; remove with --revert)"
END = "# <<< eyas-capture"
BACKUP_SUFFIX = ".eyas-orig"
BODY = ("from eyas.engines.sglang_hook import attach as _eyas_attach", "_eyas_attach(self)")


@dataclass(frozen=True)
class PatchPoint:
    file: str        # relative to sglang/srt/models
    cls: str         # class that must hold the method
    method: str      # method that must hold the statement
    attr: str        # the statement assigns self.<attr>; the block goes right after it


POINTS = (
    PatchPoint("llama.py", "LlamaForCausalLM", "__init__", "logits_processor"),
    PatchPoint("qwen2.py", "Qwen2ForCausalLM", "__init__", "logits_processor"),
    PatchPoint("qwen3.py", "Qwen3ForCausalLM", "__init__", "logits_processor"),
    PatchPoint("deepseek_v2.py", "DeepseekV2ForCausalLM", "__init__", "logits_processor"),
)


def models_dir(sglang_dir=None) -> Path:
    """sglang/srt/models of the given package dir, or of the installed sglang (found without importing it)."""
    if sglang_dir is None:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise EyasError("sglang is not installed here; pass --sglang-dir PATH/TO/sglang")
        sglang_dir = list(spec.submodule_search_locations)[0]
    d = Path(sglang_dir) / "srt" / "models"
    if not d.is_dir():
        raise EyasError(f"{d}: no such directory (is {sglang_dir} an sglang package?)")
    return d


def _is_target_stmt(stmt: ast.stmt, attr: str) -> bool:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
               and t.value.id == "self" for t in targets)


def find_point(src: str, point: PatchPoint, where: str = "") -> ast.stmt:
    """The unique statement after which the block goes; EyasError if missing or ambiguous."""
    where = where or point.file
    try:
        tree = ast.parse(src)
    except SyntaxError as e:
        raise EyasError(f"{where}: does not parse ({e})") from e
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == point.cls]
    if len(classes) != 1:
        raise EyasError(f"{where}: expected one class {point.cls}, found {len(classes)}; refusing to patch")
    methods = [n for n in classes[0].body if isinstance(n, ast.FunctionDef) and n.name == point.method]
    if len(methods) != 1:
        raise EyasError(f"{where}: expected one method {point.cls}.{point.method}, found {len(methods)}; refusing")
    hits = [s for s in methods[0].body if _is_target_stmt(s, point.attr)]
    nested = [s for s in ast.walk(methods[0]) if isinstance(s, (ast.Assign, ast.AnnAssign))
              and _is_target_stmt(s, point.attr) and s not in hits]
    if len(hits) != 1 or nested:
        raise EyasError(f"{where}: expected exactly one top-level `self.{point.attr} = ...` in "
                        f"{point.cls}.{point.method}, found {len(hits)} (+{len(nested)} nested); refusing")
    return hits[0]


def strip_block(src: str, where: str = "") -> str:
    """src without eyas's marked block(s) (exact lines inserted by `patched_source`)."""
    lines = src.splitlines(keepends=True)
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == BEGIN:
            j = i
            while j < len(lines) and lines[j].strip() != END:
                j += 1
            if j == len(lines):
                raise EyasError(f"{where}: eyas block opened but never closed; restore the file from its backup")
            i = j + 1
            continue
        out.append(lines[i])
        i += 1
    return "".join(out)


def patched_source(src: str, point: PatchPoint, where: str = "") -> str:
    """The file with the block after the insertion point; already-patched input gives the same output."""
    clean = strip_block(src, where)
    stmt = find_point(clean, point, where)
    lines = clean.splitlines(keepends=True)
    first = lines[stmt.lineno - 1]
    indent = first[: len(first) - len(first.lstrip())]
    nl = "\r\n" if first.endswith("\r\n") else "\n"
    block = [indent + BEGIN + nl] + [indent + b + nl for b in BODY] + [indent + END + nl]
    end = stmt.end_lineno
    if not lines[end - 1].endswith(("\n", "\r")):
        lines[end - 1] += nl
    return "".join(lines[:end] + block + lines[end:])


@dataclass
class FileChange:
    path: Path
    old: str
    new: str

    def diff(self) -> str:
        return "".join(difflib.unified_diff(self.old.splitlines(keepends=True), self.new.splitlines(keepends=True),
                                            fromfile=f"a/{self.path.name}", tofile=f"b/{self.path.name}"))


def plan(models: Path, points=POINTS) -> list[FileChange]:
    """What --apply would do, without writing; every point is located first (all or nothing)."""
    out = []
    for p in points:
        f = models / p.file
        if not f.exists():
            raise EyasError(f"{f}: missing; this SGLang has no {p.file}, refusing to patch")
        old = f.read_bytes().decode()
        out.append(FileChange(f, old, patched_source(old, p, str(f))))
    return out


def apply(models: Path, points=POINTS) -> list[Path]:
    changes = plan(models, points)
    written = []
    for c in changes:
        backup = c.path.with_name(c.path.name + BACKUP_SUFFIX)
        if c.new == c.old:
            continue                                         # already patched exactly so
        if BEGIN in c.old and not backup.exists():
            raise EyasError(f"{c.path}: carries an eyas block but no backup {backup.name}; refusing")
        if not backup.exists():
            backup.write_bytes(c.path.read_bytes())
        elif strip_block(c.old) != backup.read_bytes().decode():
            raise EyasError(f"{c.path}: changed since it was patched (does not match {backup.name}); "
                            f"reinstall sglang or remove the backup")
        tmp = c.path.with_name(c.path.name + ".eyas-tmp")
        tmp.write_bytes(c.new.encode())
        os.replace(tmp, c.path)
        written.append(c.path)
    return written


def revert(models: Path, points=POINTS) -> list[Path]:
    restored = []
    for p in points:
        f = models / p.file
        backup = f.with_name(f.name + BACKUP_SUFFIX)
        if not backup.exists():
            if f.exists() and BEGIN in f.read_text():
                raise EyasError(f"{f}: patched but its backup {backup.name} is gone; reinstall sglang")
            continue
        orig = backup.read_bytes()
        if strip_block(f.read_text(), str(f)).encode() != orig:
            raise EyasError(f"{f}: differs from {backup.name} outside the eyas block; refusing to overwrite it")
        f.write_bytes(orig)
        backup.unlink()
        restored.append(f)
    return restored
