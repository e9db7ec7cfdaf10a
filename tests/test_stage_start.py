"""How every stage starts, through `eyas.cli.main` as a user types it: the line naming the target and where it came
from; `--device auto` (the default everywhere) resolving to cuda only where CUDA is; bench taking the drafter's target
unless --target says otherwise, and refusing a --target that disagrees in one line; counts below 1 refused; and every
path, drafter and data check made before a target loads."""

import contextlib
import io
import json
import re
import shutil

import pytest
import torch

from test_fingerprint import save_target

import eyas.target
import eyas.target.load
from eyas.cli import main
from eyas.errors import EyasError
from eyas.knobs import resolve_device

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

TARGET_LINE = re.compile(r"eyas \w+: target .+ \(source: .+\)")
"""The line every stage starts with on stderr, naming its target and where it came from: not an error line."""

CHATS = [("hello there", "the quick fox"), ("and paris?", "return 42"), ("one two", "three four five"),
         ("abc abc", "abcabc abc"), ("what now", "nothing at all"), ("x y z", "z y x")]


def err_lines(capsys, stage):
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith(f"eyas {stage}:")]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """prepare -> capture -> train -> export through the CLI with no --target after capture: (root, the target's
    directory, {stage: its stderr lines that start with 'eyas STAGE:'})."""
    root = tmp_path_factory.mktemp("stages")
    target = save_target(root / "tiny")
    with open(root / "chats.jsonl", "w") as f:
        for i, (q, a) in enumerate(CHATS * 3):
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q},
                                                            {"role": "assistant", "content": a}]}) + "\n")
    lines = {}
    steps = {
        "prepare": ["--target", str(target), "--data", str(root / "chats.jsonl"), "--out", str(root / "prepared"),
                    "--heldout-fraction", "0", "--max-len", "128", "--device", "cpu"],
        "capture": ["--target", str(target), "--data", str(root / "prepared"), "--out", str(root / "store"),
                    "--device", "cpu"],
        "train": ["--store", str(root / "store"), "--out", str(root / "run"), "--steps", "2", "--batch-tokens", "256",
                  "--draft-vocab", "64", "--ttt-steps", "2", "--eval-fraction", "0", "--no-progress", "--device",
                  "cpu"],
        "export": ["--drafter", str(root / "run"), "--out", str(root / "export"), "--dtype", "fp32"],
    }
    for stage, argv in steps.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main([stage, *argv]) == 0, err.getvalue()
        lines[stage] = [x for x in err.getvalue().splitlines() if x.startswith(f"eyas {stage}:")]
    return root, target, lines


def bench_argv(root, *extra):
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("hello there", "abcabcabc")) + "\n")
    return ["bench", "--prompts", str(prompts), "--max-seq", "128", "--max-new-tokens", "4", "--limit", "1",
            "--device", "cpu", "--no-baselines", "--lossless-turns", "0", *extra]


def test_every_stage_names_its_target_and_where_it_came_from(pipeline):
    root, target, lines = pipeline
    assert lines["prepare"][0] == f"eyas prepare: target {target} (source: --target)"
    assert lines["capture"][0] == f"eyas capture: target {target} (source: --target)"
    # train opens what the store's capture loaded; export names the drafter's recorded target (the directory's name)
    assert lines["train"][0] == f"eyas train: target {target.resolve()} (source: the store's)"
    assert lines["export"][0] == "eyas export: target tiny (source: the drafter's manifest)"


def test_the_embedded_default_is_named_when_no_one_chose_a_target(tmp_path, capsys, monkeypatch):
    def stop(*a, **k):
        raise EyasError("stopped before the work")
    monkeypatch.setattr("eyas.data.prepare.run_prepare", stop)
    assert main(["prepare", "--out", str(tmp_path / "p"), "--device", "cpu"]) == 2
    assert err_lines(capsys, "prepare")[0] == ("eyas prepare: target smollm2-135m (source: the embedded default "
                                               "SmolLM2-135M-Instruct)")


def test_bench_runs_the_drafters_target_unless_told(pipeline, tmp_path, capsys):
    root, target, _ = pipeline
    out = tmp_path / "b.json"
    assert main(bench_argv(tmp_path, "--drafter", str(root / "run"), "--json", str(out))) == 0
    assert err_lines(capsys, "bench")[0] == f"eyas bench: target {target.resolve()} (source: the drafter's manifest)"
    assert json.loads(out.read_text())["config"]["target"] == str(target.resolve())


def test_bench_refuses_a_target_that_disagrees_in_one_line(pipeline, tmp_path, capsys):
    root, target, _ = pipeline
    other = shutil.copytree(target, tmp_path / "theta")
    raw = json.loads((other / "config.json").read_text())
    raw["rope_parameters"]["rope_theta"] = 5e5
    (other / "config.json").write_text(json.dumps(raw))
    assert main(bench_argv(tmp_path, "--drafter", str(root / "run"), "--target", str(other))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[0] == f"eyas bench: target {other} (source: --target)"
    (refusal,) = [x for x in err.splitlines() if "error" in x]
    assert refusal.startswith("eyas bench: error: ") and "does not match" in refusal and "rope_theta" in refusal
    assert "--allow-target-mismatch" in refusal


def test_bench_refuses_a_recorded_name_that_loads_nothing_here(pipeline, tmp_path, capsys, monkeypatch):
    """An exported drafter records only its target's name (here the directory's, 'tiny'): bench says to pass
    --target instead of loading the embedded default and failing on the fingerprint after a model load."""
    root, _, _ = pipeline
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(eyas.target, "load_target", loaded)
    assert main(bench_argv(tmp_path, "--drafter", str(root / "export"))) == 2
    (line,) = err_lines(capsys, "bench")
    assert line.startswith("eyas bench: error: ") and "'tiny'" in line and "pass --target" in line


def loaded(*a, **k):
    raise AssertionError("the target was loaded before the inputs were checked")


@pytest.fixture
def no_target_load(monkeypatch):
    """Loading a target fails the test: what runs before the load is all that may run."""
    monkeypatch.setattr(eyas.target, "load_target", loaded)
    monkeypatch.setattr(eyas.target.load, "load_target", loaded)


def test_bench_checks_drafter_and_prompts_before_the_target_loads(pipeline, tmp_path, capsys, no_target_load):
    root, target, _ = pipeline
    assert main(bench_argv(tmp_path, "--target", str(target), "--drafter", str(tmp_path / "no-such-run"))) == 2
    (line,) = err_lines(capsys, "bench")
    assert "no-such-run" in line and "not a drafter" in line
    argv = bench_argv(tmp_path, "--drafter", str(root / "run"))
    argv[argv.index("--prompts") + 1] = str(tmp_path / "typo.jsonl")
    for extra in ([], ["--target", str(target)]):
        assert main(argv + extra) == 2
        (line,) = err_lines(capsys, "bench")
        assert "typo.jsonl: no such file" in line


def test_capture_checks_its_data_before_the_target_loads(pipeline, tmp_path, capsys, no_target_load):
    _, target, _ = pipeline
    out = tmp_path / "store"
    assert main(["capture", "--target", str(target), "--data", str(tmp_path / "typo"), "--out", str(out),
                 "--device", "cpu"]) == 2
    (line,) = err_lines(capsys, "capture")
    assert "typo" in line and "no manifest" in line
    assert not out.exists()   # nothing written


@pytest.mark.parametrize("flag, value", [("--chain", "0"), ("--chain", "-1"), ("--limit", "0"),
                                         ("--max-new-tokens", "0"), ("--top-k", "0"), ("--depth", "0"),
                                         ("--total-tokens", "0"), ("--max-turns", "0"), ("--max-seq", "0"),
                                         ("--lossless-turns", "-1")])
def test_bench_refuses_counts_below_one_in_one_line(flag, value, tmp_path, capsys, no_target_load):
    """--chain 0 is refused, not read as the default chain of 5; nothing loads before the refusal."""
    assert main(bench_argv(tmp_path, flag, value)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"eyas bench: error: {flag} {value}: expected ")


def test_device_auto_is_cuda_only_where_cuda_is(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (resolve_device("auto"), resolve_device("cuda:1"), resolve_device("cpu")) == ("cuda", "cuda:1", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    for device in ("cuda", "cuda:0"):
        with pytest.raises(EyasError, match=f"--device {device}: CUDA is not available on this machine"):
            resolve_device(device)


@pytest.mark.parametrize("stage", ["prepare", "capture", "bench"])
def test_every_stage_defaults_to_auto_and_refuses_cuda_without_it(stage, pipeline, tmp_path, capsys, monkeypatch,
                                                                  no_target_load):
    """Left out, --device is auto in every stage (train's field default is auto already); asked for cuda on a
    machine without CUDA, each refuses in one line before any work."""
    from test_help_texts import commands

    root, target, _ = pipeline
    assert dict(commands())[stage].get_default("device") == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = {"prepare": ["prepare", "--target", str(target), "--data", str(root / "chats.jsonl"), "--out",
                        str(tmp_path / "p")],
            "capture": ["capture", "--target", str(target), "--data", str(root / "prepared"), "--out",
                        str(tmp_path / "s")],
            "bench": bench_argv(tmp_path, "--target", str(target), "--drafter", str(root / "run"))}[stage]
    argv = [a for a in argv if a != "cpu" and a != "--device"] + ["--device", "cuda"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"eyas {stage}: error: --device cuda: CUDA is not available on this machine (--device auto or " \
                   f"cpu runs here)"
    assert not (tmp_path / "p").exists() and not (tmp_path / "s").exists()


def test_capture_left_at_auto_runs_on_the_gpu_where_there_is_one(pipeline, tmp_path, monkeypatch):
    root, target, _ = pipeline
    seen = {}

    def run_capture(cfg):
        seen["device"] = cfg.device
        raise EyasError("stopped before the work")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("eyas.capture.capture.run_capture", run_capture)
    assert main(["capture", "--target", str(target), "--data", str(root / "prepared"), "--out",
                 str(tmp_path / "s")]) == 2
    assert seen == {"device": "cuda"}


@pytest.mark.parametrize("override", ["run.device=cuda", "device=cuda"])
def test_run_refuses_a_set_that_asks_for_a_gpu_on_a_cpu_machine(override, tmp_path, capsys, monkeypatch,
                                                                no_target_load):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    assert main(["run", "--preset", "cpu-demo", "--set", override, "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("eyas run: error: ") and "CUDA" in line
    assert not out.exists()   # nothing written
