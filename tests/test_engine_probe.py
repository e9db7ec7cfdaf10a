"""The capture client stops at the first reply that left no dump (hook never ran, no aux states, no vLLM file),
against real HTTP servers on 127.0.0.1 in front of the engine fakes, instead of timing out sample by sample."""

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.engine_fakes import H, make_args
from eyas.cli import main
from eyas.engines.capture import run_engine_capture
from eyas.engines.client import EngineCaptureConfig
from eyas.engines.records import sample_id_of
from eyas.engines.sglang_hook import CaptureHook, make_aux_enable_hook
from eyas.errors import EyasError
from eyas.store.reader import Store
from test_engine_client import MASKS, PREP, SAMPLES
from test_engine_lock import prepared, target_config
from test_engine_vllm import norm_target


@contextmanager
def http_engine(post):
    """A real HTTP server whose POSTs go to `post(path, body, timeout)`, the interface of the engine fakes."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                reply, code = post(self.path, body, None), 200
            except Exception as e:  # noqa: BLE001 - the engine's error reply
                reply, code = {"error": str(e)}, 500
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


class BareModel:
    """The inner model of an SGLang model class without layers_to_capture (SGLang < 0.5.23)."""


class InnerModel(BareModel):
    """An inner model that captures the stream entering the layers in layers_to_capture."""
    layers_to_capture: list = []


class Sglang:
    """One forward per /generate request, with the two --forward-hooks of launch-args before 0.5.23: the capture
    hook on the logits processor (absent when its pattern matches no module) and the aux enabler on the inner
    model. (tests/test_engine_sglang_forward.py runs them in a torch model driven as SGLang drives it.)"""

    def __init__(self, store, *, model: BareModel, hook_matches=True, warmup=True):
        self.capture = CaptureHook(store=store, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (0, 0, 1),
                                   idle_flush_s=0.2)
        self.enable, self.model, self.hook_matches = make_aux_enable_hook({"layers_to_capture": [2, 4, 5]}), \
            model, hook_matches
        self.requests, self.lock = 0, threading.Lock()
        if warmup:                                         # the server's own warm-up request
            self.enable(self.model, (), None)

    def post(self, path, body, timeout):
        assert path == "/generate"
        with self.lock:                                    # the scheduler runs one forward at a time
            self.requests += 1
            rid = body["rid"]
            if self.hook_matches:
                self.capture(None, make_args([(rid, sample_id_of(rid), 0, len(body["input_ids"]), 0)], SAMPLES,
                                             drop_aux=not getattr(self.model, "layers_to_capture", None)))
            self.enable(self.model, (), None)
        return {"text": "x", "meta_info": {"id": rid}}


def cfg(out, url, **kw):
    return EngineCaptureConfig(engine="sglang", url=url, data="fake", out=str(out), concurrency=4, retries=2,
                               commit_wait_s=5, hook_wait_s=1, **kw)


def test_a_hook_that_never_runs_stops_the_capture_after_the_first_reply(tmp_path, capsys):
    out = tmp_path / "store"
    srv = Sglang(out, model=InnerModel(), hook_matches=False)   # e.g. Kimi-K2.5 hooked at logits_processor
    with http_engine(srv.post) as url:
        t = time.monotonic()
        rc = main(["capture", "--engine", "sglang", "--url", url, "--data", str(prepared(tmp_path)), "--out", str(out),
                   "--target-config", str(target_config(tmp_path)), "--hook-wait", "1", "--no-check"])
        took = time.monotonic() - t
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no eyas capture hook ran" in err and "No modules matched" in err
    assert srv.requests == 1 and took < 5               # not 8 samples x 3 attempts, each waiting for a commit


def test_no_aux_states_on_two_samples_stop_it(tmp_path, capsys):
    """SGLang < 0.5.23 with a model lacking layers_to_capture: the hook runs, never with aux states."""
    srv = Sglang(tmp_path / "store", model=BareModel())
    with http_engine(srv.post) as url, pytest.raises(EyasError, match="no aux hidden states for samples 's0', 's1'"):
        run_engine_capture(cfg(tmp_path / "store", url), aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000,
                           samples=PREP)
    assert srv.requests == 2
    assert "Model has no layers_to_capture" in capsys.readouterr().err   # said once, by the server side


def test_one_forward_without_aux_is_the_skipped_warmup_and_the_capture_completes(tmp_path):
    """Without a warm-up the enable hook switches the aux layers on only after the first forward: that sample is
    rejected and retried, the rest go through, and each sample is in the store once."""
    out = tmp_path / "store"
    srv = Sglang(out, model=InnerModel(), warmup=False)
    with http_engine(srv.post) as url:
        m = run_engine_capture(cfg(out, url), aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000, samples=PREP)
    assert m["complete"] and sorted(Store(out).ids) == sorted(SAMPLES)
    assert srv.requests == len(SAMPLES) + 1


def test_vllm_without_extract_hidden_states_stops_after_the_first_reply(tmp_path):
    vllm_dir = tmp_path / "vllm"
    vllm_dir.mkdir()
    requests = []

    def plain_vllm(path, body, timeout):                     # served, but launched without the capture flags
        requests.append(body["request_id"])
        return {"id": "cmpl-x", "choices": [{"text": "x"}]}

    c = EngineCaptureConfig(engine="vllm", url="", data="fake", out=str(tmp_path / "store"), vllm_dir=str(vllm_dir),
                            target_config=str(norm_target(tmp_path / "target")), hook_wait_s=1)
    with http_engine(plain_vllm) as url:
        with pytest.raises(EyasError, match="no hidden-states file for it reached"):
            run_engine_capture(EngineCaptureConfig(**{**c.__dict__, "url": url}), aux_layer_ids=[2, 3, 4],
                               hidden_size=H, vocab_size=1000, samples=PREP)
    assert requests == ["s0#a0"]
