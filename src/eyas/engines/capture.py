"""run_engine_capture(cfg) -> manifest: the engine path of `eyas capture --engine sglang|vllm`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from eyas.data.prepared import load_prepared_samples
from eyas.engines.client import EngineCaptureConfig, committed, read_events, record_failures
from eyas.engines.final_norm import load_final_norm
from eyas.engines.locking import CLIENT_RANK, client_writer, finalize_store
from eyas.engines.probe import Probe
from eyas.engines.served_check import CheckConfig, locate_head, report, run_served_check
from eyas.engines.vllm_ingest import ingest_dir
from eyas.errors import EyasError
from eyas.store.lock import acquire_store_lock


def store_header(prep_manifest: dict, cfg: EngineCaptureConfig, aux_ids, hidden_size: int, vocab: int) -> dict:
    return {"target": prep_manifest.get("target"), "layers": {"aux": list(aux_ids)}, "dtype": cfg.dtype,
            "hidden_size": hidden_size, "vocab_size": vocab, "data": {"path": str(cfg.data)},
            "config": {"engine": cfg.engine, "url": cfg.url}}


def run_engine_capture(cfg: EngineCaptureConfig, *, aux_layer_ids, hidden_size: int, vocab_size: int,
                       samples=None, post=None, preflight=None, get=None) -> dict:
    """Create/resume STORE, send every sample not yet committed, retry rejected ones, finalize.

    The client is rank 0 of the store and holds its lock for the whole run (engines/locking.py): a second
    capture into the same directory, engine or in-process, is refused naming this one, and this one is
    refused while another holds it. It is taken before anything is read or sent. `preflight()` runs right
    after it, before anything is sent (the served check locates its head tensors there). `post` and `get`
    replace the HTTP calls (tests).
    """
    with acquire_store_lock(cfg.out, CLIENT_RANK):
        if preflight is not None:
            preflight()
        return _run(cfg, aux_layer_ids, hidden_size, vocab_size, samples, post, get)


def _run(cfg: EngineCaptureConfig, aux_layer_ids, hidden_size: int, vocab_size: int, samples, post, get) -> dict:
    if samples is None:
        prep, ids, masks = load_prepared_samples(cfg.data)
    else:
        prep, ids, masks = samples
    out = Path(cfg.out)
    header = store_header(prep, cfg, aux_layer_ids, hidden_size, vocab_size)
    with client_writer(out, header, wait_s=cfg.commit_wait_s, setup=True):
        pass                                                # creates or checks the store (resume)
    kw = {} if post is None else {"post": post}
    probe = Probe(cfg, out, **({} if get is None else {"get": get}))   # a reply without a dump stops the capture
    failures: dict[str, str] = {}
    for attempt in range(cfg.retries + 1):
        todo = {k: v for k, v in ids.items() if k not in committed(out)}
        if not todo:
            break
        if cfg.engine == "vllm":
            failures = _vllm_round(cfg, probe, todo, masks, header, attempt, kw)
        else:
            failures = _sglang_round(cfg, probe, out, todo, attempt, kw)
        if not failures:
            break
    if failures:
        record_failures(out, failures)
    return finalize_store(out, header, ids, wait_s=cfg.commit_wait_s)


def _sglang_round(cfg, probe, out: Path, todo: dict, attempt: int, kw) -> dict:
    resp = probe.send(todo, attempt=attempt, **kw)
    failures = {k: v for k, v in resp.items() if isinstance(v, str)}
    deadline = time.monotonic() + cfg.commit_wait_s
    while True:                                             # the hook commits on idle flush
        ev, done = read_events(out), committed(out)
        pending = [k for k in todo if k not in failures and k not in done
                   and not (k in ev and not ev[k]["ok"])]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for k in todo:
        if k in done:
            failures.pop(k, None)
        elif k not in failures:
            failures[k] = ev[k]["reason"] if k in ev and not ev[k]["ok"] else "not committed by the hook in time"
    return failures


def _vllm_round(cfg, probe, todo: dict, masks: dict, header: dict, attempt: int, kw) -> dict:
    norm = load_final_norm(cfg.target_config)              # before any request: fail fast on a bad target
    resp = probe.send(todo, attempt=attempt, **kw)
    failures = {k: v for k, v in resp.items() if isinstance(v, str)}
    names = {}
    for k, v in resp.items():
        path = (v.get("kv_transfer_params") or {}).get("hidden_states_path") if isinstance(v, dict) else None
        if path:
            names[k] = path
    ok = {k: todo[k] for k in todo if k not in failures}
    with client_writer(cfg.out, header, wait_s=cfg.commit_wait_s) as w:
        _, rejected = ingest_dir(cfg.vllm_dir, w, ok, masks, final_norm=norm, names=names)
    failures.update({r.sample_id: r.reason for r in rejected})
    return failures


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags for `eyas capture --engine ...` (wired by the capture command's owner)."""
    g = parser.add_argument_group("serving engine")
    g.add_argument("--engine", choices=["sglang", "vllm"], default=None,
                   help="capture through a running SGLang/vLLM server instead of in-process")
    g.add_argument("--url", default="http://127.0.0.1:30000", help="server base URL")
    g.add_argument("--vllm-dir", default="", help="vLLM connector shared_storage_path")
    g.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--retries", type=int, default=3, help="extra attempts per sample")
    g.add_argument("--hook-wait", type=float, default=10.0,
                   help="seconds the first reply's dump (hook event, vLLM file) may take before the capture stops")
    g.add_argument("--no-check", action="store_true",
                   help="skip the served check after the capture (`eyas engine check`: greedy tokens, post-norm final "
                        "slot, SGLang aux probe; it reads the embedding, LM head and final norm beside --target-config)")
    g.add_argument("--check-samples", type=int, default=4, help="stored samples the served check re-sends")


def served_check(args):
    """`eyas capture --engine`'s check: None with --no-check, else (preflight, run). preflight (after the store
    lock, before any request) locates the head tensors beside --target-config, so a directory without them fails
    before the capture; run() checks the finished store, prints one line per check, records STORE/check.json and
    returns the exit code (1 when a check fails). It never touches the captured samples."""
    if args.no_check:
        return None
    d = Path(args.target_config)
    target = str(d if d.is_dir() else d.parent)
    try:
        cfg = CheckConfig(engine=args.engine, url=args.url, store=args.out, target=target, n=args.check_samples,
                          timeout_s=args.request_timeout, vllm_dir=args.vllm_dir)
    except ValueError as e:
        raise EyasError(str(e)) from None

    def preflight():
        try:
            locate_head(target)
        except EyasError as e:
            raise EyasError(f"{e}; pass --no-check to capture without the served check") from None

    def run() -> int:
        res = run_served_check(cfg)
        print(report(res["rows"]))
        return 0 if res["ok"] else 1
    return preflight, run


def config_from_args(args) -> EngineCaptureConfig:
    try:
        return EngineCaptureConfig(engine=args.engine, url=args.url, data=args.data, out=args.out,
                                   vllm_dir=args.vllm_dir, target_config=getattr(args, "target_config", None) or "",
                                   concurrency=args.concurrency,
                                   timeout_s=args.request_timeout, retries=args.retries,
                                   hook_wait_s=args.hook_wait,
                                   dtype=getattr(args, "dtype", "bf16"))
    except ValueError as e:
        raise EyasError(str(e)) from None
