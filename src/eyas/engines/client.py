"""Send prepared samples to a serving engine and drive them into a verified store.

Each sample goes out as rid `{id}#a{attempt}` with max_new_tokens=1: the prompt forward is what
carries the states. Bounded concurrency (a thread pool), a timeout and retries per request (eyas/serving.py); samples
already committed to the store are never sent again (resume), and a sample id is written at most
once (the hook / ingester refuse duplicates). Failures end up in STORE/engine-failures.jsonl.

Under SGLang attention DP each group's hook knows only the samples it wrote itself, and SGLang's controller
deals requests round robin: a retry of a sample whose first reply was lost would land on another group and be
written twice. So every request of a sample carries `routed_dp_rank` = a fixed group of its id (`dp_group`),
and all attempts of a sample meet the one hook that refuses its duplicates.
"""

from __future__ import annotations

import json
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from eyas.engines.launch_args import VLLM_SERVED_NAME
from eyas.engines.records import ATTEMPT_SEP
from eyas.engines.vllm_ingest import check_sample_id
from eyas.errors import EyasError
from eyas.serving import greedy_request, post_json, retrying
from eyas.store.writer import read_sidecars

FAILURES = "engine-failures.jsonl"


@dataclass(frozen=True, kw_only=True)
class EngineCaptureConfig:
    engine: str              # "sglang" or "vllm"
    url: str                 # server base URL, e.g. http://127.0.0.1:30000
    data: str                # prepared data directory
    out: str                 # store directory
    vllm_dir: str = ""       # vLLM's shared_storage_path (vllm only)
    target_config: str = ""  # the served target's config.json; vllm: its final norm is read from beside it
    concurrency: int = 16    # requests in flight
    timeout_s: float = 600.0  # per request
    retries: int = 3         # extra attempts per sample
    dtype: str = "bf16"      # store dtype (bf16 | fp8)
    commit_wait_s: float = 60.0  # how long to wait for the hook's idle flush to commit the last shard
    hook_wait_s: float = 10.0    # after the first reply, how long its dump (hook event, vLLM file) may take to show

    def __post_init__(self):
        if self.engine not in ("sglang", "vllm"):
            raise EyasError(f"engine {self.engine!r}: expected sglang or vllm")
        if self.concurrency < 1 or self.retries < 0 or self.timeout_s <= 0 or self.hook_wait_s <= 0:
            raise EyasError("concurrency >= 1, retries >= 0, timeout_s > 0 and hook_wait_s > 0 are required")
        if self.engine == "vllm" and not self.vllm_dir:
            raise EyasError("vllm needs vllm_dir (the connector's shared_storage_path)")
        if self.engine == "vllm" and not self.target_config:
            raise EyasError("vllm needs target_config: its last slot is pre-norm, and the target's final norm "
                             "(read from the checkpoint beside config.json) turns it into the final state")


def dp_group(sample_id: str, groups: int) -> int:
    """The DP group every request of `sample_id` goes to (the same in every run and process)."""
    return zlib.crc32(sample_id.encode()) % groups


def request_body(engine: str, rid: str, ids: list[int], dp_groups: int = 1) -> tuple[str, dict]:
    """(path, body) of one capture request: a greedy one-token request (serving.greedy_request) carrying its rid;
    SGLang >= 0.5.10 with several DP groups sends it to the sample's group (dp_group)."""
    path, body = greedy_request(engine, ids, 1, model=VLLM_SERVED_NAME, rid=rid)
    if engine == "sglang" and dp_groups > 1:
        body["routed_dp_rank"] = dp_group(rid.split(ATTEMPT_SEP, 1)[0], dp_groups)
    return path, body


def send_all(cfg: EngineCaptureConfig, samples: dict, *, attempt: int, post=post_json, dp_groups: int = 1) -> dict:
    """POST each sample once (with per-request retries on any failure, backing off from 0.1 s up to 5 s) ->
    {id: response | error str}. post(url, body, timeout) -> JSON: serving.post_json, or a fake server (tests).
    dp_groups: the SGLang server's DP groups (probe.dp_groups, read from the server), > 1 routes each sample to one."""
    if cfg.engine == "vllm":  # vLLM names its file after the request id: no id may point outside its directory
        for sid in samples:
            check_sample_id(sid, cfg.data)

    def one(sid):
        def request(k):
            rid = f"{sid}{ATTEMPT_SEP}{attempt * (cfg.retries + 1) + k}"
            path, body = request_body(cfg.engine, rid, samples[sid], dp_groups)
            return post(cfg.url.rstrip("/") + path, body, cfg.timeout_s)
        try:
            return sid, retrying(request, retries=cfg.retries, backoff=0.1, max_backoff=5.0)
        except Exception as e:  # noqa: BLE001 - recorded; the next round resends it
            return sid, f"{type(e).__name__}: {e}"
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        return dict(pool.map(one, list(samples)))


def read_events(store: Path) -> dict[str, dict]:
    """Latest hook verdict per sample id, over all DP ranks."""
    out = {}
    for p in sorted(store.glob("engine-events-r*.jsonl")):
        for line in p.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                if e["ok"] or e["id"] not in out or not out[e["id"]]["ok"]:
                    out[e["id"]] = e
    return out


def event_offsets(store: Path) -> dict[Path, int]:
    """Where each hook event log ends now (new_events reads what comes after)."""
    return {p: p.stat().st_size for p in Path(store).glob("engine-events-r*.jsonl")}


def new_events(store: Path, offsets: dict[Path, int]) -> list[dict]:
    """Hook events appended since `offsets` (complete lines only), over all DP ranks."""
    out = []
    for p in sorted(Path(store).glob("engine-events-r*.jsonl")):
        with open(p, "rb") as f:
            f.seek(offsets.get(p, 0))
            data = f.read()
        out += [json.loads(x) for x in data[: data.rfind(b"\n") + 1].splitlines() if x.strip()]
    return out


def record_failures(store: Path, failures: dict) -> None:
    with open(store / FAILURES, "a") as f:
        for sid, why in sorted(failures.items()):
            f.write(json.dumps({"id": sid, "reason": why, "time": time.time()}) + "\n")


def committed(store: Path) -> set[str]:
    return {i for r in read_sidecars(store) for i in r["ids"]}


