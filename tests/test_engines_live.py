"""Live engines: capture through a real SGLang or vLLM server, then crosscheck against in-process capture.

GPU only, and only where the engine's wheels are staged: EYAS_SGLANG_SITE / EYAS_VLLM_SITE name the folder the
engine was installed into (`benchmarks/gpu/engines_live.sh install ENGINE` makes /root/site-ENGINE; its `tests ENGINE`
mode runs this file with the variable set). The server is started from `eyas engine launch-args` exactly as a user
would (plus a port and the attention backend the staging keeps), on the embedded SmolLM2 and 8 prepared ShareGPT
conversations; the store must pass `eyas engine crosscheck`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from eyas.cli import main

pytestmark = pytest.mark.gpu
SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            pytest.fail(f"server exited ({proc.returncode}):\n" + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"server not healthy after {timeout} s:\n" + log.read_text()[-3000:])


def server_command(engine: str, hf: str, store: Path, prep: Path, vllm_dir: Path, port: int) -> list[str]:
    from eyas.engines import launch_args as la
    cfg = Path(hf) / "config.json"
    if engine == "sglang":
        args = la.sglang_args(cfg, os.environ.get("EYAS_SGLANG_VERSION", "0.5.14"), model=hf, store=str(store),
                              data=str(prep))
        # the staging cuts SGLang's FA3 kernels and flashinfer's cubins: triton attention, torch sampling
        return [sys.executable, *args[1:], "--port", str(port), "--attention-backend", "triton",
                "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3"]
    args = la.vllm_args(cfg, model=hf, out_dir=str(vllm_dir), max_model_len=la.longest_prompt(prep) + 1)
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", *args[1:], "--port", str(port),
            "--gpu-memory-utilization", "0.3"]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_live_capture_passes_crosscheck(tmp_path, engine):
    site = os.environ.get(f"EYAS_{engine.upper()}_SITE")
    if not site or not Path(site).is_dir():
        pytest.skip(f"EYAS_{engine.upper()}_SITE names no staged {engine} (benchmarks/gpu/engines_live.sh install)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from eyas.target.load import resolve
    hf = str(resolve("smollm2-135m")[0])
    prep, store, vdir = tmp_path / "prep", tmp_path / "store", tmp_path / "vllm"
    assert main(["prepare", "--target", "smollm2-135m", "--data", "sharegpt", "--out", str(prep), "--limit", "8",
                 "--max-len", "512"]) == 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, str(SRC), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen(server_command(engine, hf, store, prep, vdir, port), env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, log)
        cap = ["capture", "--engine", engine, "--url", url, "--data", str(prep), "--out", str(store),
               "--target-config", str(Path(hf) / "config.json")]
        if engine == "vllm":
            cap += ["--vllm-dir", str(vdir)]
        assert main(cap) == 0, log.read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert main(["engine", "crosscheck", "--store", str(store), "--target", hf, "-n", "8"]) == 0
