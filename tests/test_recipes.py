"""Recipes: the TOML files are the presets, map one-to-one onto the stage dataclasses, refuse unknown keys and wrong
types by name, round-trip through their tables, and resolve to the stage configs checked in as a golden file.

The golden file, tests/support/golden/presets_resolved.json, holds every preset's fully resolved stage configs
(eyas.run.resolve_stages) for two target vocabularies and both kinds of held-out prompts. After a deliberate change
to a preset or to what resolve_stages derives, regenerate it and review the diff:

    EYAS_UPDATE_GOLDEN=1 python -m pytest -q tests/test_recipes.py -k golden
"""

import json
import os
import re
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path

import pytest

from eyas.bench.bench import BenchConfig
from eyas.capture.capture import CaptureConfig
from eyas.data.prepare import PrepareConfig
from eyas.errors import EyasError
from eyas.recipes import ALIASES, from_tables, preset, preset_names, table_defaults, with_overrides
from eyas.run import RunConfig, _open_state, resolve_stages
from eyas.train.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
RUN = Path("RUN")

GOLDEN = Path(__file__).parent / "support" / "golden" / "presets_resolved.json"
GOLDEN_CASES = [(name, vocab, data) for name in preset_names() for vocab in (49152, 100)   # 100: draft_vocab capped
                for data in ("sharegpt", "my/chats.jsonl")]                                # the heldout prompts alias


def golden_key(name, vocab, data):
    return f"{name} vocab={vocab} data={data}"


def as_json(configs):
    """(prepare, capture, train, bench) stage configs as JSON values: each dataclass as its class and fields."""
    def one(c):
        return None if c is None else {"class": type(c).__name__, **asdict(c)}
    prepare, capture, train, bench = configs
    value = {"prepare": one(prepare), "capture": one(capture), "train": one(train),
             "bench": {n: one(b) for n, b in bench.items()}}
    return json.loads(json.dumps(value, default=str))


_golden = {}


def golden() -> dict:
    """The checked-in resolved presets; with EYAS_UPDATE_GOLDEN=1, first rewritten from today's resolve_stages."""
    if not _golden:
        if os.environ.get("EYAS_UPDATE_GOLDEN") == "1":
            value = {golden_key(*case): as_json(stages(RunConfig(preset=case[0], data=case[2]), case[1]))
                     for case in GOLDEN_CASES}
            GOLDEN.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
        _golden.update(json.loads(GOLDEN.read_text()))
    return _golden


def stages(cfg, vocab=49152):
    s = resolve_stages(cfg, RUN, vocab_size=vocab)
    return s.prepare, s.capture, s.train, s.bench


def write(tmp_path, text, name="r.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ---- the presets are the recipe files ---------------------------------------------------------------------------

def test_shipped_recipes_are_the_presets():
    assert preset_names() == ["cpu-demo", "gpu", "gpu-dflash"]
    for name in preset_names():  # the top-level recipes/ files are the packaged ones
        assert (ROOT / "recipes" / f"{name}.toml").read_text() == (ROOT / "src/eyas/recipes" / f"{name}.toml").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"eyas.recipes" = ["*.toml", "families/*.toml"]' in pyproject   # installed eyas finds them and the families


@pytest.mark.parametrize("name", preset_names())
def test_shipped_recipe_round_trips_through_its_tables(name):
    recipe = preset(name)
    assert from_tables(recipe.tables(), name=name, where=f"{name}.toml") == recipe


@pytest.mark.parametrize("name,vocab,data", GOLDEN_CASES)
def test_recipe_file_equals_preset_equals_golden(name, vocab, data):
    by_preset = stages(RunConfig(preset=name, data=data), vocab)
    by_file = stages(RunConfig(preset=name, recipe_file=str(ROOT / "recipes" / f"{name}.toml"), data=data), vocab)
    assert by_file == by_preset
    assert as_json(by_preset) == golden()[golden_key(name, vocab, data)]
    assert RunConfig(preset=name).identity() == RunConfig(preset=name, recipe_file=f"recipes/{name}.toml").identity()


def test_cli_recipe_and_preset_resolve_alike(monkeypatch):
    import eyas.run
    from eyas.cli import main

    seen = []
    monkeypatch.setattr(eyas.run, "run_pipeline", seen.append)
    monkeypatch.chdir(ROOT)
    assert main(["run", "--recipe", "recipes/cpu-demo.toml", "--set", "train.epochs=4"]) == 0
    assert main(["run", "--preset", "cpu-demo", "--set", "epochs=4"]) == 0
    a, b = seen
    assert (a.preset, a.out, b.out) == ("cpu-demo", "runs/cpu-demo", "runs/cpu-demo")
    assert stages(a) == stages(b)
    assert stages(a)[2] == replace(stages(RunConfig(preset="cpu-demo"))[2], epochs=4)


def test_cli_refuses_preset_and_recipe_together(capsys):
    from eyas.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--preset", "gpu", "--recipe", "recipes/gpu.toml"])
    assert "not allowed with" in capsys.readouterr().err


# ---- unknown keys, wrong types, missing tables ------------------------------------------------------------------

def test_unknown_key_names_table_and_key(tmp_path):
    base = (ROOT / "recipes" / "cpu-demo.toml").read_text()
    for text, words in ((base.replace("ttt_steps = 3", "ttt_step = 3"), ["[train]", "'ttt_step'", "'ttt_steps'"]),
                        (base + "\n[[bench]]\nmethod = 'tree'\nwidth = 4\n", ["[bench]", "'width'"]),
                        (base.replace("[capture]", "[captur]"), ["[captur]"]),
                        (base.replace("[run]", "[run]\ngpus = 2"), ["[run]", "'gpus'"])):
        path = write(tmp_path, text)
        with pytest.raises(EyasError) as e:
            RunConfig(recipe_file=path)
        assert path in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    # fields eyas run sets itself are refused, with where their value comes from
    with pytest.raises(EyasError, match=r"\[train\] max_len is set by eyas run \(from \[prepare\] max_len\)"):
        RunConfig(recipe_file=write(tmp_path, base.replace("[train]", "[train]\nmax_len = 100")))
    with pytest.raises(EyasError, match=r"\[bench\] device is set by eyas run"):
        RunConfig(overrides={"bench.0.device": "cuda"})
    with pytest.raises(EyasError, match="must be an array of tables"):   # [bench] instead of [[bench]]
        RunConfig(recipe_file=write(tmp_path, "[bench]\nk = 3\n"))


def test_wrong_type_names_key_and_expected_type(tmp_path):
    base = (ROOT / "recipes" / "cpu-demo.toml").read_text()
    for old, new, want in (("limit = 1360", 'limit = "many"', r"\[prepare\] limit.*expected int or null.*got str"),
                           ("compile = false", "compile = 1", r"\[train\] compile.*expected true/false.*got int"),
                           ("lr = 3e-3", 'lr = "3e-3"', r"\[train\] lr.*expected float.*got str"),
                           ("k = 5", "k = 5.0", r"\[bench\] k.*expected int.*got float"),
                           ('device = "cpu"', "device = ['cpu']", r"\[run\] device.*expected a string.*got list")):
        path = write(tmp_path, base.replace(old, new))
        with pytest.raises(EyasError, match=want) as e:
            RunConfig(recipe_file=path)
        assert path in str(e.value)
    with pytest.raises(EyasError, match=r"--set train\.epochs=2\.5: expected int or null"):
        RunConfig(overrides={"train.epochs": 2.5})
    with pytest.raises(EyasError, match=r"--set train\.betas=.*expected a list \[float, float\]"):
        RunConfig(overrides={"train.betas": [0.9, "x"]})
    # a value of the right type that the stage refuses names the recipe and the table
    with pytest.raises(EyasError, match=r"recipe cpu-demo \[train\]: pack must be auto, on or off"):
        RunConfig(overrides={"train.pack": "maybe"})
    with pytest.raises(EyasError, match="not valid TOML"):
        RunConfig(recipe_file=write(tmp_path, "[train\n"))
    with pytest.raises(EyasError, match="cannot read"):
        RunConfig(recipe_file=str(tmp_path / "missing.toml"))
    # an int is a float, a TOML array is a tuple
    cfg = RunConfig(overrides={"train.lr": 1, "train.betas": [0.8, 0.9]})
    assert stages(cfg)[2].lr == 1.0 and isinstance(stages(cfg)[2].lr, float) and stages(cfg)[2].betas == (0.8, 0.9)


def test_missing_tables_take_the_dataclass_defaults(tmp_path):
    path = write(tmp_path, "[run]\ncapture = false\nonline = true\n\n[prepare]\nmax_len = 300\n")
    prepare, capture, train, bench = stages(RunConfig(recipe_file=path, preset="mine"), vocab=100)
    assert prepare == PrepareConfig(data="sharegpt", out=str(RUN / "prepared"), max_len=300)
    assert capture is None and bench == {}
    # [train] left out: TrainConfig's defaults, with what eyas run sets and derives
    assert train == TrainConfig(out=str(RUN / "train"), data=str(RUN / "prepared"), target="smollm2-135m",
                                device="cpu", max_len=300)
    # [capture] left out of an offline recipe: CaptureConfig's defaults
    path = write(tmp_path, "[train]\nepochs = 1\n[[bench]]\n")
    prepare, capture, train, bench = stages(RunConfig(recipe_file=path))
    assert capture == CaptureConfig(out=str(RUN / "store"), data=str(RUN / "prepared"), device="cpu")
    assert list(bench) == ["sharegpt-heldout-chain5"]                    # an empty [[bench]]: BenchConfig's defaults
    assert bench["sharegpt-heldout-chain5"] == BenchConfig(max_prompt_tokens=2048 - 512,
                                                           json_out=str(RUN / "bench/sharegpt-heldout-chain5.json"))
    with pytest.raises(EyasError, match="capture = false needs online = true"):
        RunConfig(recipe_file=write(tmp_path, "[run]\ncapture = false\n"))


# ---- --set ------------------------------------------------------------------------------------------------------

def test_set_with_table_keys_changes_that_field_and_what_derives_from_it():
    base = stages(RunConfig())
    p, c, t, b = stages(RunConfig(overrides={"prepare.max_len": 300, "train.epochs": 3, "capture.dtype": "fp8",
                                             "run.bench_dtype": "bf16", "bench.0.k": 3}))
    assert p == replace(base[0], max_len=300)
    assert c == replace(base[1], dtype="fp8")
    assert t == replace(base[2], epochs=3, max_len=300)            # train max_len follows prepare's
    (name, bc), = b.items()
    assert name == "sharegpt-heldout-chain3" and bc == replace(base[3]["sharegpt-heldout-chain5"], k=3,
                                                               max_prompt_tokens=300 - 96, json_out="RUN/bench/" + name + ".json")
    # the whole bench list, JSON null for None
    _, _, t, b = stages(RunConfig(overrides={"bench": [{"prompts": "humaneval", "method": "tree"}],
                                             "train.draft_vocab": None}))
    assert list(b) == ["humaneval-tree"] and t.draft_vocab is None
    with pytest.raises(EyasError, match=r"bench.3.k=3: the recipe has 1 \[\[bench\]\] tables"):
        RunConfig(overrides={"bench.3.k": 3})


def test_short_names_are_aliases():
    other = dict(dtype="fp32", autocast="bf16", regen_dtype="fp32", samples_per_prompt=2, regen_temperature=0.5,
                 self_prompts=4, regenerate=False, capture_dtype="fp8", steps=10, chunk_size=64, loss_on="all",
                 bench=[{"method": "tree"}])

    def in_preset(name, table, field):
        return preset(name).tables()[table].get(field, table_defaults(table)[field])

    for flat, (table, field) in ALIASES.items():   # every short name lands on its field
        cpu, value = in_preset("cpu-demo", table, field), in_preset("gpu", table, field)
        value = other[flat] if value == cpu else value
        extra = {"run.online": True} if flat == "capture" else {}   # capture = false needs online training
        tables = with_overrides(preset("cpu-demo"), {**extra, flat: value}).tables()
        assert tables[table][field] == value != cpu, flat
        assert tables == with_overrides(preset("cpu-demo"), {**extra, f"{table}.{field}": value}).tables(), flat
    assert with_overrides(preset("cpu-demo"), {"bench": other["bench"]}).bench == ({"method": "tree"},)
    # a field only one table has works unqualified; a field of several tables must be qualified
    assert stages(RunConfig(overrides={"heldout_fraction": 0.1}))[0].heldout_fraction == 0.1
    with pytest.raises(EyasError, match=r"--set seed: ambiguous, say which table: prepare\.seed, train\.seed"):
        RunConfig(overrides={"seed": 1})
    with pytest.raises(EyasError, match="--set learning_rate: unknown key"):
        RunConfig(overrides={"learning_rate": 1})
    with pytest.raises(EyasError, match="did you mean epochs"):
        RunConfig(overrides={"epoch": 1})


# ---- identity and resume ----------------------------------------------------------------------------------------

def test_identity_ignores_defaults_and_names_differences():
    ident = RunConfig(preset="cpu-demo").identity()
    assert ident["preset"] == "cpu-demo" and set(ident["recipe"]) == {"run", "prepare", "capture", "train", "bench"}
    # a value set to its field's default is the same run as one left out
    assert RunConfig(overrides={"train.chunk_size": None, "prepare.seed": 0}).identity() == ident


def test_run_json_without_a_recipe_is_refused_in_one_line(tmp_path):
    """A run.json whose identity holds flat knobs instead of a recipe (an older eyas's) is not read: refused in one
    line naming the file and the way out, before anything runs; --overwrite starts the run again."""
    run = tmp_path / "r"
    run.mkdir()
    state = {"identity": {"target": "smollm2-135m", "data": "sharegpt", "preset": "cpu-demo", "knobs": {"limit": 40}},
             "stages": {"prepare": {"done": True, "seconds": 1.0}}, "created": "2025-01-01 00:00:00"}
    (run / "run.json").write_text(json.dumps(state))
    for check_only in (True, False):
        with pytest.raises(EyasError, match=rf"^{re.escape(str(run / 'run.json'))}: written by an older eyas \(its "
                                            rf"identity holds no recipe\); use another --out, or --overwrite to start "
                                            rf"it again$"):
            _open_state(RunConfig(out=str(run), overrides={"prepare.limit": 40}), run, check_only=check_only)
    assert (run / "run.json").exists()
    state = _open_state(RunConfig(out=str(run), overwrite=True), run)
    assert state["stages"] == {} and state["identity"] == RunConfig().identity()



def test_a_field_set_back_to_its_default_is_named_with_the_default(tmp_path):
    """A recipe's identity leaves out default values; the refusal still shows both sides (2048 != 4096)."""
    from eyas.train.config import TrainConfig

    run = tmp_path / "r"
    run.mkdir()
    cfg = RunConfig(out=str(run), preset="cpu-demo")
    (run / "run.json").write_text(json.dumps({"identity": cfg.identity(), "stages": {}, "created": "2026-12-03"}))
    default = TrainConfig.batch_tokens
    assert cfg.recipe.train["batch_tokens"] != default
    with pytest.raises(EyasError, match=rf"recipe\.train\.batch_tokens: {cfg.recipe.train['batch_tokens']} != "
                                        rf"{default}\)") as e:
        _open_state(RunConfig(out=str(run), preset="cpu-demo", overrides={"train.batch_tokens": default}), run)
    assert "<missing>" not in str(e.value)

def test_every_table_field_is_typed_and_settable_or_owned():
    """Every stage field is either settable from a recipe (and so checkable by its type) or set by eyas run."""
    from eyas.knobs import knobs
    from eyas.recipes import OWNED, stage_classes, _type_name

    for table, cls in stage_classes().items():
        for k in knobs(cls).values():   # a nested config's fields (PrepareConfig.regen) are keys of the table
            assert _type_name(k.type) and not is_dataclass(k.type), (table, k.name)
        assert set(OWNED.get(table, {})) <= set(knobs(cls)), table


def test_the_gpu_preset_on_the_cpu_trains_with_attention_auto():
    """The gpu preset's flex attention (no backward off CUDA) becomes auto on a CPU rehearsal; asked for with --set,
    it is refused at once, before any stage runs."""
    gpu = resolve_stages(RunConfig(preset="gpu"), Path("RUN"), vocab_size=49152).train
    cpu = resolve_stages(RunConfig(preset="gpu", overrides={"run.device": "cpu"}), Path("RUN"), vocab_size=49152).train
    assert (gpu.attention, cpu.attention) == ("flex", "auto")
    with pytest.raises(EyasError, match=r"^--set train.attention=flex: flex attention trains on CUDA only"):
        resolve_stages(RunConfig(preset="gpu", overrides={"run.device": "cpu", "train.attention": "flex"}),
                       Path("RUN"), vocab_size=49152)
