"""`eyas prepare|capture|train|bench --recipe NAME|FILE`: the recipe's table of that stage sets the command's defaults,
a flag given wins, and the shipped family recipes (eyas/recipes/families) build valid stage configs. Runs go through
`eyas.cli.main` as a user types them, on a tiny target the test saves."""

import contextlib
import io
import json

import pytest

from test_fingerprint import save_target

from eyas.bench.command import bench_config
from eyas.cli import build_parser, main, with_recipe
from eyas.data.prepare import PrepareConfig
from eyas.errors import EyasError
from eyas.knobs import from_args
from eyas.recipes import family_names
from eyas.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def parsed(argv):
    parser = build_parser()
    return with_recipe(parser, argv, parser.parse_args(argv))


def run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


@pytest.mark.parametrize("name", family_names())
def test_every_family_recipe_builds_each_stage_config(name, tmp_path):
    """Each table of a shipped family recipe, through its command's parser, is a config its stage accepts."""
    prep = from_args(PrepareConfig, parsed(["prepare", "--recipe", name, "--data", "x.jsonl", "--out", "p",
                                               "--device", "cpu"]))
    assert prep.regenerate and prep.max_len == 8192 and prep.regen.max_new_tokens == 4096
    args = parsed(["capture", "--recipe", name, "--engine", "sglang", "--url", "http://h:1", "--data", "p", "--out",
                   "s", "--target-config", "c.json"])
    assert args.dtype == "fp8"
    train = from_args(TrainConfig, parsed(["train", "--recipe", name, "--store", "s", "--out", "r"]))
    assert train.max_len == prep.max_len and train.pack == "on" and train.compile
    assert train.method == ("dflash" if name.endswith("-dflash") else "eagle3")
    bench = bench_config(parsed(["bench", "--recipe", name, "--drafter", "r"]), "cpu")
    assert bench.spec.method == "chain" and bench.max_new_tokens == 1024


def test_a_flag_given_wins_over_the_recipe_and_the_line_says_so(capsys):
    args = parsed(["train", "--recipe", "deepseek-v3", "--store", "s", "--out", "r", "--lr", "5e-4"])
    cfg = from_args(TrainConfig, args)
    assert cfg.lr == 5e-4 and cfg.ttt_steps == 6 and cfg.draft_vocab == 32000 and cfg.norm_before_fc
    line = capsys.readouterr().err.strip()
    assert line.startswith("eyas train: recipe deepseek-v3: ") and "lr=0.0005 (the flag; the recipe: 0.0001)" in line


def test_method_dflash_over_an_eagle_recipe_keeps_the_shared_settings():
    """The recipe's EAGLE-3-only keys (ttt_steps, draft_vocab, norm_before_fc) are left out for --method dflash
    instead of refused as if the user had typed them."""
    cfg = from_args(TrainConfig, parsed(["train", "--recipe", "deepseek-v3", "--store", "s", "--out", "r",
                                         "--method", "dflash"]))
    assert cfg.method == "dflash" and cfg.lr == 1e-4 and cfg.epochs == 5 and cfg.ttt_steps is None
    cfg = from_args(TrainConfig, parsed(["train", "--recipe", "deepseek-v3-dflash", "--store", "s", "--out", "r",
                                         "--method", "eagle3"]))
    assert cfg.method == "eagle3" and cfg.block_size is None and cfg.anchors == TrainConfig.anchors


def test_bench_takes_a_recipe_of_one_bench_table_only(capsys):
    argv = ["bench", "--recipe", "gpu", "--drafter", "r"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eyas bench: error: recipe gpu has ") and "[[bench]] tables" in err


def test_an_unknown_recipe_is_refused_in_one_line_with_a_suggestion(tmp_path, capsys):
    assert main(["prepare", "--recipe", "deepseek-v4", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "recipe 'deepseek-v4': no such file" in err and "did you mean 'deepseek-v3'?" in err
    assert not (tmp_path / "p").exists()
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nepoch = 3\n")
    assert main(["train", "--recipe", str(bad), "--store", "s", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and "unknown key 'epoch' in table [train]" in err and "did you mean 'epochs'?" in err
    assert not (tmp_path / "r").exists()


def test_prepare_and_train_run_with_a_recipe_file(tmp_path):
    """A real prepare -> capture -> train with the stage settings in a recipe file: what each stage's output records
    is the recipe's value, and a flag still wins."""
    target = save_target(tmp_path / "tiny")
    with open(tmp_path / "chats.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"question {i} " * 6}, {"role": "assistant", "content": f"answer {i} " * 9},
                {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "then more " * 4}]}) + "\n")
    recipe = tmp_path / "mine.toml"
    recipe.write_text('[prepare]\nmax_len = 96\nmax_turns = 1\nheldout_fraction = 0.0\n\n'
                      '[train]\nsteps = 2\nbatch_tokens = 128\ndraft_vocab = 64\nttt_steps = 2\nlr = 3e-4\n'
                      'eval_fraction = 0.0\n')
    rc, err = run(["prepare", "--recipe", str(recipe), "--target", str(target), "--data", str(tmp_path / "chats.jsonl"),
                   "--out", str(tmp_path / "p"), "--device", "cpu"])
    assert rc == 0, err
    assert "eyas prepare: recipe mine: max_len=96, max_turns=1, heldout_fraction=0.0" in err
    cfg = json.loads((tmp_path / "p" / "manifest.json").read_text())["config"]
    assert cfg["max_len"] == 96 and cfg["max_turns"] == 1
    rc, err = run(["capture", "--target", str(target), "--data", str(tmp_path / "p"), "--out", str(tmp_path / "s"),
                   "--device", "cpu"])
    assert rc == 0, err
    rc, err = run(["train", "--recipe", str(recipe), "--store", str(tmp_path / "s"), "--out", str(tmp_path / "r"),
                   "--ttt-steps", "3", "--no-progress", "--device", "cpu"])
    assert rc == 0, err
    cfg = json.loads((tmp_path / "r" / "manifest.json").read_text())["config"]
    assert cfg["lr"] == 3e-4 and cfg["max_len"] == 96 and cfg["steps"] == 2 and cfg["ttt_steps"] == 3


def test_stage_recipes_refuse_what_eyas_run_sets_itself(tmp_path, capsys):
    bad = tmp_path / "paths.toml"
    bad.write_text('[prepare]\nout = "somewhere"\n')
    assert main(["prepare", "--recipe", str(bad), "--out", str(tmp_path / "p")]) == 2
    assert "[prepare] out is set by eyas run" in capsys.readouterr().err
    with pytest.raises(EyasError, match="no such file"):
        parsed(["train", "--recipe", str(tmp_path / "missing.toml"), "--store", "s", "--out", "r"])
