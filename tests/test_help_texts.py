"""Every `eyas` command's --help, as a user reads it: a description for every command, the flags of every stage in
titled groups, no internal names (module paths, source files, config field identifiers, function names), and every
flag a help text names is a flag of that command."""

import argparse
import re

import pytest

from eyas.bench.bench import BenchConfig
from eyas.bench.engine import EngineBenchConfig
from eyas.capture.capture import CaptureConfig
from eyas.cli import build_parser
from eyas.data.prepare import PrepareConfig
from eyas.engines.capture import EngineCaptureConfig
from eyas.knobs import knobs
from eyas.run import RunConfig
from eyas.train.config import TrainConfig

CONFIGS = (PrepareConfig, CaptureConfig, TrainConfig, BenchConfig, EngineBenchConfig, EngineCaptureConfig, RunConfig)

INTERNAL = [r"\beyas\.\w", r"\b\w+\.py\b", r"DEVICE_DEFAULTS", r"\brun_capture\b", r"\bTarget object\b",
            r"\bload_target\b", r"\bopen_drafter\b", r"\w\(\)"]
"""Names of the source a help text must not show: module paths, source files, eyas's own identifiers, calls."""

SNAKE = re.compile(r"(?<![\w-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w-])")
"""An identifier joined by '_' (a flag is spelled with '-', a metavar in capitals)."""

OUTSIDE_NAMES = {"lk_alpha": "a value of train --loss", "lk_lambda": "a value of train --loss",
                 "shared_storage_path": "vLLM's own connector setting", "extract_hidden_states": "vLLM's own method"}
"""'_'-joined words a help text may show: names a user types or meets outside eyas's source."""

STAGES = ("prepare", "capture", "train", "bench", "export")

def commands():
    """(name, parser) of `eyas` and every command and subcommand under it."""
    out = []

    def walk(p, name):
        out.append((name, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for n, sp in a.choices.items():
                    walk(sp, f"{name} {n}".strip())
    walk(build_parser(), "")
    return out


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")   # argparse wraps at the terminal: no flag is cut at a hyphen


def test_every_command_has_a_description():
    missing = [name or "eyas" for name, p in commands() if not (p.description or "").strip()]
    assert missing == []


def test_help_texts_show_no_internal_names():
    fields = {k for cls in CONFIGS for k in knobs(cls) if "_" in k}
    for name, p in commands():
        text = p.format_help()
        for pattern in INTERNAL:
            assert not re.search(pattern, text), (name or "eyas", pattern, re.search(pattern, text))
        words = set(SNAKE.findall(text))
        assert not words & fields, (name, sorted(words & fields))        # a field's identifier, not its flag
        assert words <= set(OUTSIDE_NAMES), (name, sorted(words - set(OUTSIDE_NAMES)))


def test_every_flag_a_help_text_names_is_a_flag():
    """A flag in a quoted `eyas OTHER ...` line is a flag of that command; any other flag a help text names is its
    command's own, or (prose that points to another command) a flag of some eyas command: never a field's name turned
    into a flag that does not exist."""
    parsers = dict(commands())
    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")

    def flags_of(name):
        return {s for a in parsers[name]._actions for s in a.option_strings}

    every = set().union(*(flags_of(name) for name in parsers))
    quoted = 0
    for name, p in commands():
        text = p.format_help()
        for span in re.findall(r"`eyas ([^`]*)`", text):
            words = span.split()
            other = next(" ".join(words[:i]) for i in range(len(words), 0, -1) if " ".join(words[:i]) in parsers)
            assert set(flag.findall(span)) <= flags_of(other), (name, span)
            quoted += 1
        named = set(flag.findall(re.sub(r"`eyas [^`]*`", "", text)))
        assert named <= every, (name, sorted(named - every))
        if name in STAGES:   # the stages name only their own flags
            assert named <= flags_of(name), (name, sorted(named - flags_of(name)))
    assert quoted   # the quoted commands were read, not skipped


@pytest.mark.parametrize("stage", STAGES + ("run",))
def test_every_stage_groups_its_flags(stage):
    """Every flag of a stage sits under a titled group; train's --method stays first, above them."""
    p = dict(commands())[stage]
    titled = [g for g in p._action_groups if g.title not in ("options", "positional arguments")]
    assert len(titled) >= 3, [g.title for g in titled]
    ungrouped = [a.option_strings[0] for g in p._action_groups if g not in titled for a in g._group_actions
                 if a.option_strings and a.dest != "help"]
    assert ungrouped == (["--method"] if stage == "train" else [])


def test_prepare_still_has_a_flag_for_every_field():
    """The groups of `eyas prepare` leave out no PrepareConfig knob, its nested RegenConfig's included (a knob
    missing from them gets its flag under "other settings")."""
    p = dict(commands())["prepare"]
    dests = {a.dest for a in p._actions}
    assert set(knobs(PrepareConfig)) <= dests and "regen_temperature" in dests
