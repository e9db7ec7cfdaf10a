"""`eyas train --store S --out R` with no other flag takes its defaults from the device.

Through `eyas.cli.main`, as a user types it: on the CPU, K and the draft vocabulary left open become the cpu-demo's
(K=3, 8k; about 20x faster on 2 cores than EAGLE-3's K=7, 32k), the choice is printed on stderr, and the run records
the resolved values.
"""

import json

from test_fingerprint import samples, save_target

from eyas.capture.capture import CaptureConfig, run_capture
from eyas.cli import main
from eyas.target import load_target
from eyas.train.config import DEVICE_DEFAULTS


def test_train_with_no_flags_takes_the_cpu_defaults_and_says_so(tmp_path, capsys, monkeypatch):
    # captured from a target directory given relative to one working directory, trained from another: the store
    # records a spec that loads the target again (a directory's fingerprint identity is only its name)
    save_target(tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path / "models")
    run_capture(CaptureConfig(out=str(tmp_path / "store"), target="tiny", device="cpu", progress=False),
                samples=samples())
    monkeypatch.chdir(tmp_path)
    target = load_target(str(tmp_path / "models" / "tiny"))
    capsys.readouterr()

    assert main(["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    cpu = DEVICE_DEFAULTS["cpu"]
    assert (cpu["ttt_steps"], cpu["draft_vocab"]) == (3, 8192)
    assert "eyas train: on cpu: ttt_steps 3, draft_vocab 8192 (defaults for cpu; set them to change)" in err
    from eyas.target.device import cpu_bf16_fast
    assert f"eyas train: autocast {'bf16' if cpu_bf16_fast() else 'off (fp32)'} on cpu: " in err   # and why

    config = json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]
    assert (config["device"], config["ttt_steps"], config["draft_vocab"]) == ("auto", 3, 8192)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(len(r["acc_k"]) == 3 for r in rows)          # K=3 was trained, not EAGLE-3's 7
    vocab = json.loads((tmp_path / "run" / "vocab" / "summary.json").read_text())
    assert vocab["size"] == min(8192, target.model.config.vocab_size)   # capped at the target's vocabulary
