"""The knobs of a config dataclass: each field's name, type, default and the docstring under it.

One reader of the stage dataclasses for the places that list their fields: recipes (a table's keys, their types and
defaults) and the command lines (`add_flags`, which builds argparse flags from them). A field whose type is itself a
config dataclass (BenchConfig.spec, a SpecConfig) contributes its fields flat, under their own names.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str
    """The field name (a recipe key; the flag is --name with '-' for '_')."""
    type: object
    """The resolved annotation, e.g. int, str | None, tuple[float, float]."""
    default: object
    """The field's default (dataclasses.MISSING when it has none or a default_factory)."""
    doc: str
    """The attribute docstring under the field, on one line ('' when it has none)."""


def field_docs(cls) -> dict[str, str]:
    """Field name -> the string literal that follows its annotated assignment in the class body, on one line."""
    return dict(_docs(cls))


@functools.cache
def _docs(cls) -> tuple[tuple[str, str], ...]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a class built at run time): no docstrings
        return ()
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)).body
    out = []
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            out.append((node.target.id, " ".join(inspect.cleandoc(after.value.value).split())))
    return tuple(out)


def knobs(cls) -> dict[str, Knob]:
    """The knobs of a config dataclass in field order; a field holding a config dataclass gives its own knobs."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    out: dict[str, Knob] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            inner = list(knobs(tp).values())
            if dataclasses.is_dataclass(f.default):  # the outer default's values are the defaults
                inner = [dataclasses.replace(k, default=getattr(f.default, k.name)) for k in inner]
        else:
            inner = [Knob(f.name, tp, f.default, docs.get(f.name, ""))]
        for k in inner:
            assert k.name not in out, f"{cls.__name__}: knob {k.name!r} appears twice"
            out[k.name] = k
    return out
