"""`eyas prepare --device`: local regeneration runs the target where the user says, and the device is speed, not
data: a prepared directory resumes on another device."""

import json

import pytest
import torch

from support.deepseek_twin import CORPUS, save_twin
from eyas.cli import main
from eyas.data.prepare import PrepareConfig
from eyas.data.regenerate import RegenConfig
from eyas.errors import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


def chats(path, n=6):
    words = " ".join(CORPUS[:2]).split()
    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": " ".join(words[i:i + 5])},
                    {"role": "assistant", "content": " ".join(words[i + 1:i + 7])}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return path


def test_device_is_checked_and_left_out_of_the_identity():
    with pytest.raises(EyasError, match="--device 'tpu'"):
        PrepareConfig(out="x", regenerate=True, regen=RegenConfig(device="tpu"))
    a = PrepareConfig(out="x", regenerate=True, regen=RegenConfig(device="cpu")).identity()
    assert a == PrepareConfig(out="x", regenerate=True, regen=RegenConfig(device="cuda")).identity()
    assert "device" not in a and "device" not in a["regen"]


@pytest.mark.gpu
def test_regeneration_runs_on_cuda(tmp_path):
    """The twin regenerates on the GPU through the CLI (memory is allocated there) and the directory it wrote
    resumes from the CPU as complete: the device is not part of what was prepared."""
    target = save_twin(tmp_path / "twin")
    data = chats(tmp_path / "chats.jsonl")
    argv = ["prepare", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "prep"), "--max-len", "96",
            "--heldout-fraction", "0", "--regenerate", "--max-new-tokens", "8"]
    assert main(argv + ["--device", "cuda"]) == 0
    assert torch.cuda.max_memory_allocated() > 0
    manifest = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert manifest["counts"]["conversations"] == 6
    assert main(argv + ["--device", "cpu"]) == 0   # resume: same identity, nothing left to do
