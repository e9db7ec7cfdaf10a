"""Both background warm-ups start in the run directory, not in the directory `eyas run` was started from: that one
may be deleted while the run goes on, and a Python started in a deleted directory cannot import torch."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from eyas.bench import prewarm
from eyas.train import prewarm as train_prewarm
from eyas.train.config import TrainConfig


class _Popen:
    """subprocess.Popen's stand-in: records how it was called, starts nothing."""

    calls: list = []

    def __init__(self, args, **kw):
        _Popen.calls.append((args, kw))
        self.pid = 4242

    def poll(self):
        return 0


def test_both_warm_ups_start_in_the_run_directory_with_absolute_paths(tmp_path, monkeypatch):
    """The launcher passes cwd=<run dir> to both warm-ups, and the relative paths of their specs (the target, a
    held-out data file, an --init drafter) are made absolute, since from the run directory they would name nothing;
    names that are not paths here stay names."""
    run, here = tmp_path / "runs" / "gpu", tmp_path / "work"
    (run / "logs").mkdir(parents=True)
    (here / "models" / "mine").mkdir(parents=True)
    (here / "chats.jsonl").write_text("")
    monkeypatch.chdir(here)
    monkeypatch.setattr(_Popen, "calls", [])
    monkeypatch.setattr(subprocess, "Popen", _Popen)
    logs = Path("../runs/gpu/logs")   # a relative run directory, as `--out` may give it

    train = TrainConfig(store="store", out="train", target="models/mine", init="models/mine")
    train_prewarm.start(logs, train, target_spec="models/mine", device="cpu", dtype="fp32")
    bench = SimpleNamespace(device="cpu", to_dict=lambda: {"target": "models/mine", "drafter": None,
                                                           "prompts": "heldout:chats.jsonl"})
    monkeypatch.setattr(prewarm, "planned_drafter_config", lambda train, target: SimpleNamespace(to_dict=dict))
    prewarm.start(logs, {"heldout-chain5": bench, "long-chain5": SimpleNamespace(
        device="cpu", to_dict=lambda: {"target": "smollm2-135m", "drafter": None, "prompts": "long"})},
        train, None, target_spec="models/mine", dtype="fp32")

    assert [kw["cwd"] for _, kw in _Popen.calls] == [run.resolve(), run.resolve()]
    assert all(Path(a).is_absolute() for args, _ in _Popen.calls for a in args[-2:])  # its spec and result files
    mine = str((here / "models" / "mine").resolve())
    t = json.loads((run / "logs" / "train-prewarm-spec.json").read_text())
    assert (t["target"], t["train"]["target"], t["train"]["init"]) == (mine, mine, mine)
    b = json.loads((run / "logs" / "prewarm-spec.json").read_text())
    assert b["target"] == mine and b["benches"]["heldout-chain5"] == {
        "target": mine, "drafter": None, "prompts": f"heldout:{(here / 'chats.jsonl').resolve()}"}
    assert b["benches"]["long-chain5"] == {"target": "smollm2-135m", "drafter": None, "prompts": "long"}


PARENT = textwrap.dedent("""
    import os, shutil, subprocess, sys
    from pathlib import Path
    from eyas.bench.prewarm import Prewarm
    from eyas.target.fingerprint import cache_root   # what `eyas run` has imported before its directory goes
    shutil.rmtree(os.getcwd())                        # the working tree laid anew under the running parent
    child = [sys.executable, "-c", "import torch; print('torch', torch.ones(2).sum().item())"]
    if sys.argv[2] == "launcher":
        p = Prewarm(Path(sys.argv[1]), {}, cmd=lambda spec, result: child, name="prewarm")
        p.wait(120)
        print(p.proc.returncode)
    else:                                             # a child that inherits the deleted directory
        print(subprocess.run(child, capture_output=True).returncode)
""")


def test_a_warm_up_imports_torch_after_the_parents_directory_was_deleted(tmp_path):
    """A parent whose working directory is deleted before it starts the warm-up: the warm-up, started by the real
    launcher in the run directory, imports torch; the same child left in the parent's directory does not (the
    failure seen on the GPU machine, so this test does reproduce it)."""
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    rc = {}
    for how in ("launcher", "inherited"):
        gone = tmp_path / f"gone-{how}"
        gone.mkdir()
        out = subprocess.run([sys.executable, "-c", PARENT, str(logs), how], cwd=gone, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0 and not gone.exists(), out.stderr
        rc[how] = int(out.stdout.split()[-1])
    assert rc["launcher"] == 0 and "torch 2.0" in (logs / "prewarm.log").read_text()
    assert rc["inherited"] != 0
