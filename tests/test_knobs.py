"""eyas.knobs: a config dataclass's fields (type, default, docstring) and the argparse flags built from them; every
stage command's flags are its config's fields, or named here as the exceptions."""

import argparse
from dataclasses import dataclass, fields

import pytest

from eyas.bench.bench import BenchConfig
from eyas.bench.command import NOT_FIELDS as BENCH_NOT_FIELDS
from eyas.capture.capture import CaptureConfig
from eyas.cli import build_parser
from eyas.data.prepare import PrepareConfig
from eyas.data.regenerate import RegenConfig
from eyas.decode.spec import SpecConfig
from eyas.knobs import add_flags, field_docs, flag_name, from_args, from_knobs, knobs
from eyas.run import RunConfig
from eyas.train.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class Toy:
    out: str
    """Where it goes."""
    steps: int = 3
    """Steps to take, 100% of them
    (a docstring over two lines)."""
    rate: float | None = None
    """A rate (None: none)."""
    name: str | None = None
    fast: bool = False
    """Go fast."""
    check: bool = True
    """Check the result."""
    pair: tuple[int, int] = (1, 2)
    """Two numbers."""


@dataclass(frozen=True, kw_only=True)
class Outer:
    label: str = "x"
    """A label."""
    toy: Toy = Toy(out="o", steps=7)
    """A nested config: its knobs are the outer's, flat."""


def parser(cls=Toy, names=None, **special):
    p = argparse.ArgumentParser(prog="toy")
    add_flags(p, cls, names, **special)
    return p


def test_knobs_read_types_defaults_and_docstrings():
    assert field_docs(Toy) == {"out": "Where it goes.", "steps": "Steps to take, 100% of them (a docstring over two "
                               "lines).", "rate": "A rate (None: none).", "fast": "Go fast.",
                               "check": "Check the result.", "pair": "Two numbers."}    # `name` has none
    k = knobs(Toy)
    assert list(k) == [f.name for f in fields(Toy)]
    assert (k["steps"].type, k["steps"].default) == (int, 3) and k["rate"].type == float | None
    assert k["name"].doc == "" and k["pair"].type == tuple[int, int]
    # a nested config gives its knobs flat, with the outer default's values as their defaults
    o = knobs(Outer)
    assert list(o) == ["label"] + [f.name for f in fields(Toy)] and o["steps"].default == 7
    assert o["steps"].doc == k["steps"].doc
    assert list(knobs(BenchConfig))[3:3 + len(fields(SpecConfig))] == [f.name for f in fields(SpecConfig)]
    assert flag_name("max_new_tokens") == "--max-new-tokens"


def test_from_knobs_nests_the_flat_knobs_of_a_nested_config():
    """Flat knob values (flags, a recipe table) build a config whose nested config field takes its own knobs, over
    the field's default or a value given for it; a class that sorts its keywords itself gets them flat."""
    assert from_knobs(Outer, {"label": "y", "steps": 9, "fast": True}) == Outer(
        label="y", toy=Toy(out="o", steps=9, fast=True))
    assert from_knobs(Outer, {"toy": Toy(out="p"), "rate": 0.5}) == Outer(toy=Toy(out="p", rate=0.5))
    assert from_knobs(Outer, {}) == Outer()
    assert from_knobs(BenchConfig, {"k": 3, "limit": 2}) == BenchConfig(k=3, limit=2)
    with pytest.raises(TypeError, match="nope"):
        from_knobs(Outer, {"nope": 1})


def test_flags_from_fields_types_none_defaults_bools_and_help():
    p = parser()
    names = {a.dest: a for a in p._actions if a.dest != "help"}
    assert "pair" not in names                                   # a tuple needs its own type=, so it is left out
    assert names["out"].required and names["steps"].type is int and names["rate"].type is float
    assert names["name"].type is None and names["name"].default is None               # str: argparse's own
    assert names["fast"].option_strings == ["--fast"] and names["check"].option_strings == ["--no-check"]
    # the defaults are the fields': parsing nothing but the required flag builds the default config
    assert from_args(Toy, p.parse_args(["--out", "o"])) == Toy(out="o")
    a = p.parse_args(["--out", "o", "--steps", "5", "--rate", "0.5", "--name", "n", "--fast", "--no-check"])
    assert from_args(Toy, a) == Toy(out="o", steps=5, rate=0.5, name="n", fast=True, check=False)
    assert from_args(Toy, a, steps=9).steps == 9                 # values a command sets itself win
    with pytest.raises(SystemExit):
        p.parse_args(["--steps", "x", "--out", "o"])            # the type is checked
    text = " ".join(p.format_help().split())
    assert "Steps to take, 100% of them (a docstring over two lines). (default: 3)" in text   # % escaped
    assert "--rate RATE A rate (None: none)." in text and "(default: None)" not in text
    assert "--no-check turn off: check the result." in text
    with pytest.raises(TypeError, match="Toy.pair"):
        parser(names=["pair"])
    a = parser(names=["out", "pair"], pair={"type": lambda s: tuple(map(int, s.split(",")))}).parse_args(
        ["--out", "o", "--pair", "3,4"])
    assert from_args(Toy, a) == Toy(out="o", pair=(3, 4))
    # special keywords: other option strings (dest stays the field), choices, a replaced default
    p = parser(names=["out", "name", "steps"], name={"flags": ("--name", "-n"), "choices": ["a", "b"]},
               steps={"default": 4})
    assert from_args(Toy, p.parse_args(["--out", "o", "-n", "b"])) == Toy(out="o", name="b", steps=4)
    with pytest.raises(SystemExit):
        p.parse_args(["--out", "o", "-n", "c"])


# Each stage command's config, and the flags that are not one of its fields (with why).
RECIPE = {"recipe": "a recipe whose stage table sets the defaults (eyas.cli.with_recipe)"}
COMMANDS = {
    "prepare": (PrepareConfig, {"verbose": "prints the skipped records; not a prepare setting", **RECIPE}),
    "capture": (CaptureConfig, {"target_config": "--engine only: the served model's config.json",
                                **{n: "--engine: EngineCaptureConfig (eyas.engines.capture.add_engine_args)"
                                   for n in ("engine", "url", "vllm_dir", "concurrency", "request_timeout",
                                             "retries", "hook_wait")},
                                **{n: "--engine: the served check after the capture (eyas.engines.served_check)"
                                   for n in ("no_check", "check_samples")}, **RECIPE}),
    "train": (TrainConfig, RECIPE),
    "bench": (BenchConfig, {**{n: "--chain K | --tree set method and k; the mismatch override opens the drafter"
                               for n in BENCH_NOT_FIELDS},
                            **{n: "--engine: EngineBenchConfig (eyas.bench.engine)"
                               for n in ("engine", "url", "plain_url", "model", "request_timeout", "concurrency",
                                         "trust_remote_code", "drafter_kind")}, **RECIPE}),
    "run": (RunConfig, {}),
}
# Flags whose default is not the field's, and why.
OTHER_DEFAULTS = {**{(c, "device"): "auto: cuda when available, resolved by the command"
                     for c in ("prepare", "capture", "bench")},
                  ("bench", "target"): "None: the drafter's recorded target, resolved by the command",
                  ("run", "preset"): "None: gpu when CUDA is there",
                  ("run", "out"): "None: runs/<name>", ("run", "overrides"): "a list of --set pairs"}
# Commands without a config dataclass: their flags are the library function's arguments, declared by hand.
HAND_DECLARED = ("store", "export", "engine", "target")


def subparsers(p):
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_flag_is_a_config_field_or_a_named_exception():
    commands = subparsers(build_parser())
    assert set(commands) == set(COMMANDS) | set(HAND_DECLARED)
    for name, (cls, exceptions) in COMMANDS.items():
        k = knobs(cls)
        dests = {a.dest: a for a in commands[name]._actions if a.dest != "help"}
        assert set(exceptions) <= set(dests), name                    # no stale exception
        for dest, a in dests.items():
            if dest in exceptions:
                continue
            assert dest in k, f"eyas {name} {a.option_strings}: not a field of {cls.__name__} nor an exception"
            if (name, dest) not in OTHER_DEFAULTS and not a.required:
                assert a.default == k[dest].default, (name, dest)
            if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                assert k[dest].type is bool and a.option_strings[0] == flag_name(
                    dest if k[dest].default is False else "no_" + dest), (name, dest)


def test_command_defaults_build_the_default_configs():
    """A command given only its required flags builds its config's defaults (the flags add no defaults of their
    own); the flags that were declared by hand before the helper keep their names and meaning."""
    p = build_parser()
    assert from_args(TrainConfig, p.parse_args(["train", "--store", "S", "--out", "R"])) == TrainConfig(
        store="S", out="R")
    # the device (auto) and bench's target (the drafter's) are resolved by the commands, which pass them in
    assert from_args(PrepareConfig, p.parse_args(["prepare", "--out", "P"]), device="cpu") == PrepareConfig(out="P")
    assert from_args(CaptureConfig, p.parse_args(["capture", "--data", "D", "--out", "S"]),
                     device="cpu") == CaptureConfig(data="D", out="S")
    bench = dict(device="cpu", target="smollm2-135m")
    assert from_args(BenchConfig, p.parse_args(["bench"]), **bench) == BenchConfig()
    a = p.parse_args(["bench", "--chain", "3", "--no-baselines", "--json", "r.json", "--top-p", "0.5"])
    assert from_args(BenchConfig, a, k=a.chain, **bench) == BenchConfig(k=3, baselines=False, json_out="r.json",
                                                                        top_p=0.5)
    a = p.parse_args(["prepare", "--out", "P", "--temperature", "0.7", "--regen-dtype", "bf16"])
    assert from_args(PrepareConfig, a, device="cpu") == PrepareConfig(
        out="P", regen=RegenConfig(regen_temperature=0.7, regen_dtype="bf16"))
    a = p.parse_args(["train", "--data", "D", "--target", "T", "--out", "R", "--no-progress", "--pack", "on"])
    assert from_args(TrainConfig, a) == TrainConfig(data="D", target="T", out="R", progress=False, pack="on")
    a = p.parse_args(["capture", "--data", "D", "--out", "S", "--layers", "1,2,3", "--dtype", "fp8"])
    assert from_args(CaptureConfig, a, device="cpu") == CaptureConfig(data="D", out="S", layers=(1, 2, 3),
                                                                      dtype="fp8")
    with pytest.raises(SystemExit):
        p.parse_args(["train", "--store", "S", "--data", "D", "--out", "R"])     # still one of --store | --data
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--chain", "3", "--tree"])
