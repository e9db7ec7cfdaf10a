"""Recipes: TOML files whose tables map one-to-one onto the stage dataclasses of `eyas run`.

    [run]      RunKnobs (below): the device, the target's dtypes, capture or online training
    [prepare]  eyas.data.prepare.PrepareConfig; its generation knobs (regen_temperature, max_new_tokens, ...: the
               fields of eyas.data.regenerate.RegenConfig, PrepareConfig.regen) are keys of the table itself
    [capture]  eyas.capture.capture.CaptureConfig
    [train]    eyas.train.config.TrainConfig
    [[bench]]  eyas.bench.bench.BenchConfig, one table per benchmark; its decode knobs (method, k, top_k, ...:
               the fields of eyas.decode.spec.SpecConfig, BenchConfig.spec) are keys of the table itself

A key is a field name of its dataclass, with a value of the field's type. A key or table left out takes the
dataclass default (TOML has no null: leave the key out, or `--set KEY=null`); no [[bench]] table means no
benchmarks. Unknown tables and keys are errors that name them, and so are the fields `eyas run` sets itself
(OWNED: paths, the target, the device, values derived from other tables). The presets `--preset NAME` are
the NAME.toml files next to this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

import eyas.target.device  # its functions looked up at call time: tests patch them
from eyas.bench.bench import BenchConfig
from eyas.capture.capture import CaptureConfig
from eyas.data.prepare import PrepareConfig
from eyas.errors import EyasError
from eyas.knobs import knobs
from eyas.train.config import DFLASH_ONLY, EAGLE_ONLY, TrainConfig

DTYPES = ("fp32", "bf16", "fp16")
FAMILIES = "families"


@dataclass(frozen=True, kw_only=True)
class RunKnobs:
    """The [run] table: what the pipeline shares between its stages."""

    device: str = "cpu"
    """cpu or cuda: every stage runs there (capture, train and bench take it; bench compiles on cuda)."""
    dtype: str = "fp32"
    """Weights dtype of the target in prepare, capture and train: fp32, bf16, fp16, or auto (bf16 on CUDA and on
    CPUs with native bf16 instructions, fp32 elsewhere: emulated bf16 is far slower, eyas.target.device)."""
    bench_dtype: str | None = None
    """Weights dtype of the target in bench (None: `dtype`); fp32 makes the lossless check exact."""
    capture: bool = True
    """Run the capture stage (a hidden-state store on disk)."""
    online: bool = False
    """Train online from the prepared data (the target runs inside each step) instead of from the store."""
    budget_minutes: float | None = None
    """Size the run to this many minutes on the machine it meets (eyas.sizing: measure the stages' work here, then
    scale the conversations and bench prompts down until the estimate fits). None or 0: run the recipe as written. Not
    part of the run's identity: the plan it chose is saved with the run."""
    prewarm_bench: bool | None = None
    """Compile the bench's graphs in a background process while the drafter trains (eyas/bench/prewarm.py), so the
    bench finds them in the caches on disk. None: where a bench compiles (cuda) and a second copy of the target fits
    beside training (eyas.bench.prewarm.AUTO_SHARE). Not part of the run's identity."""
    prewarm_train: bool | None = None
    """Compile training's graphs in a background process while prepare runs (eyas/train/prewarm.py), so the train
    stage finds them in the caches on disk. Online training only. None: where training compiles on cuda and a second
    copy of the target fits beside prepare. Not part of the run's identity."""

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise EyasError(f"device {self.device!r}: expected cpu or cuda")
        for name in ("dtype", "bench_dtype"):
            value = getattr(self, name)
            if value not in DTYPES + ("auto",) and not (name == "bench_dtype" and value is None):
                raise EyasError(f"{name} {value!r}: expected one of {', '.join(DTYPES)}")
        if self.budget_minutes is not None and not self.budget_minutes >= 0:
            raise EyasError(f"budget_minutes {self.budget_minutes!r}: expected minutes (0: no sizing)")
        if self.bench_dtype == "auto":
            raise EyasError("bench_dtype 'auto': give fp32, bf16 or fp16 (or leave it out to follow dtype)")
        if not self.capture and not self.online:
            raise EyasError("capture = false needs online = true (offline training reads the store that "
                            "capture writes)")


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> bf16 on CUDA or a CPU with native bf16, else fp32; any other name unchanged."""
    if dtype != "auto":
        return dtype

    return "bf16" if device == "cuda" or eyas.target.device.cpu_bf16_fast() else "fp32"


def stage_classes() -> dict[str, type]:
    """Table name -> its dataclass."""
    return {"run": RunKnobs, "prepare": PrepareConfig, "capture": CaptureConfig, "train": TrainConfig,
            "bench": BenchConfig}


TABLES = ("run", "prepare", "capture", "train", "bench")
# Fields eyas run sets itself, per table, and where their value comes from.
_TARGET, _DEVICE, _TRUST = "--target", "[run] device", "--trust-remote-code"
OWNED: dict[str, dict[str, str]] = {
    "prepare": {"target": _TARGET, "data": "--data", "out": "the run directory", "overwrite": "the run's redo",
                "trust_remote_code": _TRUST},
    "capture": {"target": _TARGET, "data": "the run's prepared/", "out": "the run directory",
                "device": _DEVICE, "overwrite": "the run's redo", "progress": "--quiet", "trust_remote_code": _TRUST},
    "train": {"target": _TARGET, "data": "[run] online", "store": "[run] online", "out": "the run directory",
              "device": _DEVICE, "max_len": "[prepare] max_len", "resume": "the run directory",
              "progress": "--quiet", "trust_remote_code": _TRUST},
    "bench": {"target": _TARGET, "drafter": "the run's drafter", "device": _DEVICE,
              "compile": "[run] device (on cuda)",
              "json_out": "the run directory", "dtype": "[run] bench_dtype", "trust_remote_code": _TRUST},
}
# Short --set names: each one's table and field (`--set regen_limit=100` is prepare.regenerate_limit). A field name
# that only one table has works unqualified too (resolve_key).
ALIASES: dict[str, tuple[str, str]] = {
    "device": ("run", "device"), "dtype": ("run", "dtype"), "bench_dtype": ("run", "bench_dtype"),
    "capture": ("run", "capture"), "online": ("run", "online"),
    "limit": ("prepare", "limit"), "max_len": ("prepare", "max_len"), "max_turns": ("prepare", "max_turns"),
    "regenerate": ("prepare", "regenerate"), "regen_limit": ("prepare", "regenerate_limit"),
    "max_new_tokens": ("prepare", "max_new_tokens"), "regen_batch": ("prepare", "batch_size"),
    "gen_batch": ("prepare", "gen_batch"), "regen_dtype": ("prepare", "regen_dtype"),
    "samples_per_prompt": ("prepare", "samples_per_prompt"), "regen_temperature": ("prepare", "regen_temperature"),
    "self_prompts": ("prepare", "self_prompts"), "capture_dtype": ("capture", "dtype"),
    "draft_vocab": ("train", "draft_vocab"), "ttt_steps": ("train", "ttt_steps"), "epochs": ("train", "epochs"),
    "steps": ("train", "steps"), "lr": ("train", "lr"), "batch_tokens": ("train", "batch_tokens"),
    "chunk_size": ("train", "chunk_size"), "loss_on": ("train", "loss_on"), "pack": ("train", "pack"),
    "attention": ("train", "attention"), "compile": ("train", "compile"), "eval_every": ("train", "eval_every"),
    "autocast": ("train", "autocast"),
}


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A checked recipe: [run] as RunKnobs, each stage table as the fields it sets (values of the field types)."""

    name: str
    run: RunKnobs = field(default_factory=RunKnobs)
    prepare: dict = field(default_factory=dict)
    capture: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    bench: tuple[dict, ...] = ()

    def tables(self) -> dict:
        """The recipe as TOML-shaped tables (fresh copies)."""
        run = {f.name: getattr(self.run, f.name) for f in fields(RunKnobs)}
        return {"run": run, "prepare": dict(self.prepare), "capture": dict(self.capture), "train": dict(self.train),
                "bench": [dict(b) for b in self.bench]}

    def identity(self) -> dict:
        """Every value that differs from its field's default, in JSON types: what a resumed run must match."""
        def sparse(name, table):
            defaults = table_defaults(name)
            return {k: v for k, v in table.items() if v != defaults.get(k, dataclasses.MISSING)}

        t = self.tables()
        t["run"].pop("prewarm_bench")  # these change no output: a resumed run may turn them on or off
        t["run"].pop("prewarm_train")
        t["run"].pop("budget_minutes")  # the plan it chose is in the identity, as overrides (eyas.run)
        out = {name: sparse(name, t[name]) for name in TABLES if name != "bench"}
        out["bench"] = [sparse("bench", b) for b in t["bench"]]
        return json.loads(json.dumps(out))


def shown_identity(identity: dict) -> dict:
    """A run identity with each recipe table's left-out fields written as their defaults: for messages, so a field
    set back to its default reads `2048 != 4096`, not `2048 != '<missing>'`."""
    if not isinstance(identity.get("recipe"), dict):
        return identity

    def fill(name, table):
        defaults = {k: v for k, v in table_defaults(name).items() if v is not dataclasses.MISSING}
        return {**json.loads(json.dumps(defaults, default=str)), **table}

    rec = identity["recipe"]
    shown = {name: fill(name, rec[name]) for name in TABLES if name != "bench" and isinstance(rec.get(name), dict)}
    if isinstance(rec.get("bench"), list):
        shown["bench"] = [fill("bench", b) for b in rec["bench"]]
    return {**identity, "recipe": {**rec, **shown}}


def table_defaults(name: str) -> dict:
    """Field -> default of a recipe table (dataclasses.MISSING where the field has none)."""
    return {k.name: k.default for k in knobs(stage_classes()[name]).values()}


# ---- types ---------------------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(tp) is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_type_name(args[0])}"
        return "a list [" + ", ".join(_type_name(a) for a in args) + "]"
    return {bool: "true/false", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value, tp):
    """`value` as a value of the field type `tp` (an int is a float, a list a tuple); TypeError if it is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _convert(value, a)
                except TypeError:
                    pass
    elif origin is tuple and isinstance(value, (list, tuple)):
        try:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_convert(v, args[0]) for v in value)
            if len(value) == len(args):
                return tuple(_convert(v, a) for v, a in zip(value, args))
        except TypeError:
            pass
    elif tp is bool and isinstance(value, bool):
        return value
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif tp is str and isinstance(value, str):
        return value
    raise TypeError(_type_name(tp))


def _check_key(table: str, key: str, where: str) -> None:
    cls = stage_classes()[table]
    names = list(knobs(cls))
    if key in OWNED.get(table, {}):
        raise EyasError(f"{where}: [{table}] {key} is set by eyas run (from {OWNED[table][key]}), not by a recipe")
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        raise EyasError(f"{where}: unknown key {key!r} in table [{table}] (not a field of {cls.__name__}"
                        + (f"; did you mean {close[0]!r}?)" if close else ")"))


def _finite(value) -> bool:
    """False for a NaN or infinite float anywhere in `value` (JSON and TOML both spell them; no field takes one)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return all(_finite(v) for v in value) if isinstance(value, (list, tuple)) else True


def _value(table: str, key: str, value, what: str):
    """Check one key of a table and return its value converted to the field type."""
    if not _finite(value):
        raise EyasError(f"{what}: expected a finite number for [{table}] {key}, got {json.dumps(value)}")
    try:
        return _convert(value, knobs(stage_classes()[table])[key].type)
    except TypeError as e:
        raise EyasError(f"{what}: expected {e} for [{table}] {key}, got {type(value).__name__} "
                        f"{json.dumps(value, default=str)}") from None


# ---- recipes from tables, files and presets --------------------------------------------------------------------

def from_tables(tables: dict, *, name: str, where: str) -> Recipe:
    """Check TOML-shaped tables and build the Recipe; `where` names the file (or --set) in errors."""
    if not isinstance(tables, dict):
        raise EyasError(f"{where}: expected tables {', '.join(TABLES)}")
    for table in tables:
        if table not in TABLES:
            raise EyasError(f"{where}: unknown table [{table}] (expected {', '.join(TABLES)})")
    checked: dict = {}
    for table in TABLES:
        raw = tables.get(table, [] if table == "bench" else {})
        entries = raw if table == "bench" else [raw]
        if table == "bench" and not (isinstance(raw, (list, tuple)) and all(isinstance(b, dict) for b in raw)):
            raise EyasError(f"{where}: bench must be an array of tables ([[bench]] in TOML), got {json.dumps(raw)}")
        if table != "bench" and not isinstance(raw, dict):
            raise EyasError(f"{where}: [{table}] must be a table, got {json.dumps(raw)}")
        out = []
        for b in entries:
            for key in b:
                _check_key(table, key, where)
            out.append({k: _value(table, k, v, f"{where}: [{table}] {k} = {json.dumps(v, default=str)}")
                        for k, v in b.items()})
        checked[table] = out if table == "bench" else out[0]
    try:
        run = RunKnobs(**checked["run"])
    except EyasError as e:
        raise EyasError(f"{where}: [run] {e}") from None
    return Recipe(name=name, run=run, prepare=checked["prepare"], capture=checked["capture"], train=checked["train"],
                  bench=tuple(checked["bench"]))


def _toml():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise EyasError("reading a recipe needs Python 3.11 or `pip install tomli`") from None
    return tomllib


def load_recipe(path: str | Path, *, name: str | None = None) -> Recipe:
    """Read and check a recipe file (its name: the file's stem unless given)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise EyasError(f"recipe {path}: cannot read it ({e.strerror or e})") from None
    return parse_recipe(text, name=name or path.stem, where=str(path))


def parse_recipe(text: str, *, name: str, where: str) -> Recipe:
    tomllib = _toml()
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise EyasError(f"{where}: not valid TOML ({e})") from None
    return from_tables(tables, name=name, where=where)


def family_names() -> list[str]:
    """The recipes of eyas/recipes/families/: stage settings for a target family whose target an engine serves (the
    stage commands take them with --recipe NAME; docs/engines.md uses them)."""
    return sorted(p.name[:-len(".toml")] for p in (resources.files(__name__) / FAMILIES).iterdir()
                  if p.name.endswith(".toml"))


def named_recipe(spec: str) -> Recipe:
    """A recipe by name (a preset or a family recipe) or a recipe file's path."""
    if spec in preset_names():
        return preset(spec)
    if spec in family_names():
        res = resources.files(__name__) / FAMILIES / f"{spec}.toml"
        return parse_recipe(res.read_text(), name=spec, where=f"recipe {spec} ({res})")
    if Path(spec).expanduser().is_file():
        return load_recipe(Path(spec).expanduser())
    close = difflib.get_close_matches(spec, preset_names() + family_names(), n=1)
    raise EyasError(f"recipe {spec!r}: no such file, and no shipped recipe of that name (presets: "
                    f"{', '.join(preset_names())}; families: {', '.join(family_names())})"
                    + (f"; did you mean {close[0]!r}?" if close else ""))


def stage_defaults(recipe: Recipe, stage: str, *, method: str | None = None) -> dict:
    """A recipe's table for one stage command (`eyas prepare|capture|train|bench --recipe`), keyed as that command's
    parsed arguments: the defaults its flags override. The [run] table is eyas run's and is not read here. For
    train, `method` (the drafter family the command will train) drops the recipe's keys that apply only to the
    other family, so `--method dflash` over an EAGLE-3 recipe keeps its shared settings, and max_len is [prepare]
    max_len, as eyas run sets it. For bench, the recipe must
    hold one [[bench]] table; its method and k become --tree / --chain K and graph_round --graph-round."""
    if stage == "bench":
        if len(recipe.bench) != 1:
            raise EyasError(f"recipe {recipe.name} has {len(recipe.bench)} [[bench]] tables: eyas bench --recipe takes "
                            f"a recipe with exactly one (eyas run runs them all)")
        table = dict(recipe.bench[0])
        method, k = table.pop("method", None), table.pop("k", None)
        if method == "tree":
            table["tree"] = True
        elif k is not None:
            table["chain"] = k
        if "graph_round" in table:
            table["one_graph_round"] = table.pop("graph_round")
        return table
    table = dict(getattr(recipe, stage))
    if stage == "train":
        if "max_len" in recipe.prepare:  # as eyas run derives it: rows as long as the prepared conversations
            table["max_len"] = recipe.prepare["max_len"]
        other = EAGLE_ONLY if (method or table.get("method", "eagle3")) == "dflash" else DFLASH_ONLY
        table = {k: v for k, v in table.items() if k not in other}
    return table


def preset_names() -> list[str]:
    return sorted(p.name[:-len(".toml")] for p in resources.files(__name__).iterdir() if p.name.endswith(".toml"))


def preset(name: str) -> Recipe:
    """The recipe shipped as eyas/recipes/NAME.toml."""
    names = preset_names()
    if name not in names:
        raise EyasError(f"unknown preset {name!r}: expected one of {', '.join(names)} (or --recipe FILE)")
    res = resources.files(__name__) / f"{name}.toml"
    return parse_recipe(res.read_text(), name=name, where=f"preset {name} ({res})")


# ---- --set ------------------------------------------------------------------------------------------------------

def resolve_key(key: str) -> tuple:
    """A --set key -> its place: (table, field), ("bench",) or ("bench", index, field).

    TABLE.FIELD, bench.N.FIELD, the whole `bench` list, a short name (ALIASES), or a field name that only one table
    has."""
    parts = key.split(".")
    if parts == ["bench"]:
        return ("bench",)
    if len(parts) == 3 and parts[0] == "bench" and parts[1].isdigit():
        _check_key("bench", parts[2], f"--set {key}")
        return ("bench", int(parts[1]), parts[2])
    if len(parts) == 2 and parts[0] in TABLES and parts[0] != "bench":
        _check_key(parts[0], parts[1], f"--set {key}")
        return tuple(parts)
    if len(parts) == 1:
        if key in ALIASES:
            return ALIASES[key]
        homes = [t for t, cls in stage_classes().items() if t != "bench"
                 and key in knobs(cls) and key not in OWNED.get(t, {})]
        if len(homes) == 1:
            return (homes[0], key)
        if len(homes) > 1:
            raise EyasError(f"--set {key}: ambiguous, say which table: " + ", ".join(f"{t}.{key}" for t in homes))
    known = [f"{t}.{k}" for t, cls in stage_classes().items() if t != "bench" for k in knobs(cls)
             if k not in OWNED.get(t, {})]
    close = difflib.get_close_matches(key, known + list(ALIASES), n=1)
    raise EyasError(f"--set {key}: unknown key (expected TABLE.FIELD with TABLE one of {', '.join(TABLES[:-1])}, "
                    f"or bench.N.FIELD, or bench=[...]" + (f"; did you mean {close[0]}?)" if close else ")"))


def with_overrides(recipe: Recipe, overrides: dict) -> Recipe:
    """The recipe with each --set KEY=VALUE applied in order, every value checked against its field type."""
    if not overrides:
        return recipe
    tables = recipe.tables()
    for key, value in overrides.items():
        place, what = resolve_key(key), f"--set {key}={json.dumps(value, default=str)}"
        if place == ("bench",):
            if not (isinstance(value, list) and all(isinstance(b, dict) for b in value)):
                raise EyasError(f"{what}: expected a list of tables like [{{\"method\": \"chain\", \"k\": 3}}], "
                                f"got {type(value).__name__}")
            for b in value:
                for k, v in b.items():
                    _check_key("bench", k, what)
                    _value("bench", k, v, what)
            tables["bench"] = [dict(b) for b in value]
        elif place[0] == "bench":
            _, i, k = place
            if i >= len(tables["bench"]):
                raise EyasError(f"{what}: the recipe has {len(tables['bench'])} [[bench]] tables")
            tables["bench"][i][k] = _value("bench", k, value, what)
        else:
            table, k = place
            tables[table][k] = _value(table, k, value, what)
    return from_tables(tables, name=recipe.name, where=f"recipe {recipe.name} with --set")

