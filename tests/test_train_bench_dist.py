"""benchmarks.train under torchrun (2 processes, gloo on the CPU, the tiny shape): the rehearsal of the
`torchrun --nproc_per_node 2 -m benchmarks.train --shapes kimi --fsdp` on 2 GPUs. With --fsdp each rank holds
half of the drafter's parameters (FSDP2 shards them); with DDP each holds all of them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, *extra) -> dict:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "benchmarks.train", "--device", "cpu", "--shapes", "tiny", "--seqs", "128",
                        "--steps", "1", "--attention", "dense", "--no-record", "--json", str(out), *extra],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp2_under_torchrun_shards_the_drafter_over_the_two_ranks(tmp_path):
    ddp, fsdp = run(tmp_path), run(tmp_path, "--fsdp")
    assert (ddp["world"], ddp["wrap"], fsdp["world"], fsdp["wrap"]) == (2, "ddp", 2, "fsdp2")
    full, shard = ddp["rows"][0]["param_mib_rank"], fsdp["rows"][0]["param_mib_rank"]
    assert 0.45 * full <= shard <= 0.55 * full          # each rank holds its half (rounded up per tensor)
    assert fsdp["rows"][0]["tokens"] == ddp["rows"][0]["tokens"] > 0 and fsdp["rows"][0]["tok_s"] > 0
