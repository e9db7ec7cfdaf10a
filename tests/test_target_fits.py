"""A target too large for the machine is refused before a weight is read, naming its size, the free memory and the
engine path; the size comes from the safetensors headers, exact against the model's own parameters."""

import json
import struct
import time
from pathlib import Path

import pytest
import torch

from support.models import make_tiny_llama
from eyas.errors import EyasError
from eyas.target import load_target
from eyas.target.device import free_bytes
from eyas.target.meta import weights_bytes


def huge_target(root: Path, times: float = 4.0) -> Path:
    """A model directory whose one safetensors file declares fp32 weights `times` this machine's available memory:
    a real header and a sparse file of the declared length (no disk blocks), with a tiny Llama's config."""
    d = root / "huge"
    make_tiny_llama().config.save_pretrained(d)
    cols = 1 << 16
    rows = int(times * free_bytes("cpu") / (4 * cols)) + 1
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [rows, cols],
                                                       "data_offsets": [0, rows * cols * 4]}}).encode()
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + rows * cols * 4)
    return d


def test_weights_bytes_equals_the_parameters_in_each_dtype(tmp_path):
    model = make_tiny_llama()
    model.save_pretrained(tmp_path / "t")
    n = sum(p.numel() for p in model.state_dict().values() if p.is_floating_point())
    assert weights_bytes(tmp_path / "t", torch.float32) == 4 * n
    assert weights_bytes(tmp_path / "t", torch.bfloat16) == 2 * n


def test_a_weightless_copy_reports_the_index_total(tmp_path):
    from support.deepseek_twin import save_twin, weightless_copy

    full = save_twin(tmp_path / "full")
    light = weightless_copy(full, tmp_path / "light")
    total = json.loads((full / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert weights_bytes(light, torch.float32) == total


def test_a_target_larger_than_free_memory_is_refused_before_loading(tmp_path):
    d = huge_target(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(EyasError) as e:
        load_target(str(d))
    msg = str(e.value)
    assert time.perf_counter() - t0 < 10       # no weight read: a header and /proc/meminfo
    assert "\n" not in msg and "cannot be loaded in process" in msg and "docs/engines.md" in msg
    need = float(msg.split("take ")[1].split(" GiB")[0].replace(",", ""))
    free = float(msg.split("has ")[1].split(" GiB")[0].replace(",", ""))
    assert need > 3.5 * free > 0


def test_eyas_run_refuses_it_in_one_line_and_writes_nothing(tmp_path, capsys):
    from eyas.cli import main

    d = huge_target(tmp_path)
    out = tmp_path / "run"
    assert main(["run", "--preset", "cpu-demo", "--target", str(d), "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "cannot be loaded in process" in err[0], err
    assert not out.exists()


def test_a_target_that_fits_still_loads(tmp_path):
    from test_hostile import tiny_target_dir

    target = load_target(str(tiny_target_dir(tmp_path)))
    assert target.hidden_size == 32
