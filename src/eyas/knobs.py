"""The knobs of a config dataclass: each field's name, type, default and the docstring under it.

One reader of the stage dataclasses for the places that list their fields: recipes (a table's keys, their types and
defaults) and the command lines (`add_flags`, which builds argparse flags from them). A field whose type is itself a
config dataclass (BenchConfig.spec, a SpecConfig; PrepareConfig.regen, a RegenConfig) contributes its fields flat,
under their own names, and `from_knobs` builds the config back from those flat values.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.target.resolve import EMBEDDED


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


def to_json(cfg) -> dict:
    """A config as a JSON-ready dict: dataclasses.asdict with its tuple fields as lists (what from_known reads)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def from_known(cls, d: dict, what: str):
    """cls(**d), refusing keys that are not fields of cls by name (a config read back from JSON)."""
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise EyasError(f"{what}: unknown keys {unknown}")
    return cls(**d)


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


# ---- command-line flags ----------------------------------------------------------------------------------------

def flag_name(name: str) -> str:
    """A field name as a flag: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


def add_flags(parser, cls, names=None, **special: dict) -> None:
    """One argparse flag per knob of `cls` (`names`, default every int, float, str and bool knob, in field order)
    on `parser` (or an argument group).

    Derived from the field: the flag --field-name, its type (int, float, str; `X | None` takes an X), its default
    (a field without one is a required flag) and its help (the field's docstring). A bool field is a switch:
    --name (store_true) when its default is False, --no-name (store_false) when it is True; dest is always the
    field name, so `from_args` finds it. special[name] holds argparse keywords that replace the derived ones
    (choices, required, default, metavar, help, type), plus flags=(...) for other option strings."""
    every = knobs(cls)
    if names is None:  # every knob a flag can carry: a tuple or dict field needs its own type=, so it is named
        names = [n for n, k in every.items() if _flag_type(k.type) is not None or "type" in special.get(n, {})]
    for name in names:
        k, kw = every[name], dict(special.get(name, {}))
        tp = _flag_type(k.type)
        if tp is None and "type" not in kw:
            raise TypeError(f"{cls.__name__}.{name}: a {k.type} field needs type= in add_flags")
        args = {"dest": name, "help": _escape(as_flags(k.doc, every))}
        if tp is bool:
            off = k.default is True
            flags = (flag_name("no_" + name),) if off else (flag_name(name),)
            args["action"] = "store_false" if off else "store_true"
            if off:
                args["help"] = "turn off: " + args["help"][:1].lower() + args["help"][1:]
        else:
            flags = (flag_name(name),)
            if tp not in (str, None):
                args["type"] = tp
            if k.default is dataclasses.MISSING:
                args["required"] = True
            else:
                args["default"] = k.default
        flags = kw.pop("flags", flags)
        args.update(kw)
        if args.get("default") is not None and tp is not bool and "help" not in kw:
            args["help"] += " (default: %(default)s)"
        parser.add_argument(*flags, **args)


def add_command(subparsers, name: str, run, help: str):
    """The parser of the command `name`, which runs `run(args)`: `help` is its line in the list of commands, and
    run's docstring the description atop its --help (as a field's docstring is its flag's help), so the docstring is
    written for the user."""
    p = subparsers.add_parser(name, help=help, description=inspect.getdoc(run))
    p.set_defaults(func=run)
    return p


def from_args(cls, args, **values):
    """cls built from the parsed flags named after its knobs, with `values` on top (what a command sets itself)."""
    given = {n: getattr(args, n) for n in knobs(cls) if hasattr(args, n)}
    return from_knobs(cls, {**given, **values})


def from_knobs(cls, values: dict):
    """cls built from values keyed by knob name (parsed flags, a recipe table): the knobs of a field that holds a
    config dataclass (PrepareConfig.regen) go into that field, over the field's value or default. A class whose
    __init__ takes keywords of its own (BenchConfig, which places its spec knobs itself) gets them as they are."""
    if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values()):
        return cls(**values)
    return cls(**_nested(cls, values))


def _nested(cls, values: dict) -> dict:
    kw, hints = dict(values), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            inner = {k: kw.pop(k) for k in knobs(tp) if k in kw}
            if inner:
                kw[f.name] = dataclasses.replace(kw.get(f.name, f.default), **_nested(tp, inner))
    return kw


def _flag_type(tp):
    """int, float, str or bool for a field type (the X of `X | None`); None for any other (a tuple, a dict)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else None
    return tp if tp in (int, float, str, bool) else None


def _escape(text: str) -> str:
    return text.replace("%", "%%")


def as_flags(doc: str, names) -> str:
    """A field docstring as help text: every other field it names by its identifier (`regen_temperature`,
    `max_len`) becomes the flag a user types (--regen-temperature, --max-len). Only names joined by '_' are
    rewritten, and a one-word field only in backticks (`out` is also a plain word); a file name (feature_cache.py)
    is left alone."""
    names = sorted(names, key=len, reverse=True)
    ticked = r"`(" + "|".join(map(re.escape, names)) + r")`"
    doc = re.sub(ticked, lambda m: flag_name(m.group(1)), doc)
    joined = [n for n in names if "_" in n]
    if not joined:
        return doc
    bare = r"(?<![\w.-])(" + "|".join(map(re.escape, joined)) + r")(?![\w-]|\.\w)"
    return re.sub(bare, lambda m: flag_name(m.group(1)), doc)


# ---- what every stage command says and resolves the same way ----------------------------------------------------

DEVICE_HELP = "auto (cuda when a CUDA GPU is present, else cpu), cpu, cuda or cuda:N"
"""The help of every stage's --device, whose default is auto."""


def resolve_device(device: str) -> str:
    """A --device value as the device to run on: auto is cuda when a CUDA GPU is present, else cpu; cuda asked for on
    a machine without one is refused in one line (the stage would otherwise fail deep inside torch)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.split(":")[0] == "cuda" and not torch.cuda.is_available():
        raise EyasError(f"--device {device}: CUDA is not available on this machine (--device auto or cpu runs here)")
    return device


FROM_FLAG = "--target"
FROM_DRAFTER = "the drafter's manifest"
FROM_STORE = "the store's"


def default_source(spec: str) -> str:
    """How the line of `announce_target` names a target no one chose: the embedded default by its model name."""
    if spec in EMBEDDED:
        return f"the embedded default {Path(EMBEDDED[spec][1]).name.split('.')[0]}"   # SmolLM2-135M-Instruct
    return "the default"


def flag_or_default(spec: str, default: str) -> str:
    """The source of a --target value that defaults to `default`: the flag, or the embedded default."""
    return FROM_FLAG if spec != default else default_source(spec)


def announce_target(stage: str, spec: str, source: str) -> None:
    """One line on stderr as a stage starts, naming the target it runs with and where that name came from, e.g.
    `eyas bench: target /models/Qwen3-8B (source: the drafter's manifest)`. Under torchrun rank 0 says it."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"eyas {stage}: target {spec} (source: {source})", file=sys.stderr)
