"""eyas/serving.py, the client every stage talks to SGLang and vLLM servers through: the engines' request bodies
and replies, the retry schedule, and each way a request fails, against a loopback server."""

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eyas import serving
from eyas.errors import EyasError
from eyas.serving import (NOT_JSON, REFUSED, STATUS, TIMEOUT, Client, ServerError, get_json, greedy_request,
                          post_json, reply_ids, retrying)


def test_greedy_requests_in_each_engines_spelling():
    assert greedy_request("sglang", (5, 6), 1, model="eyas", rid="s0#a0") == (
        "/generate", {"input_ids": [5, 6], "rid": "s0#a0",
                      "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    assert greedy_request("vllm", (5, 6), 1, model="eyas", rid="s0#a0", token_ids=True) == (
        "/v1/completions", {"model": "eyas", "prompt": [5, 6], "max_tokens": 1, "temperature": 0.0,
                            "return_token_ids": True, "request_id": "s0#a0"})
    assert greedy_request("sglang", [5], 8, stop=[2])[1] == {
        "input_ids": [5], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [2]}}
    assert greedy_request("vllm", [5], 8, model="m", stop=[2], token_ids=True)[1] == {
        "model": "m", "prompt": [5], "max_tokens": 8, "temperature": 0.0, "stop_token_ids": [2],
        "return_token_ids": True}
    assert greedy_request("sglang", [5], 1, top_logprobs=3)[1] == {
        "input_ids": [5], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
        "top_logprobs_num": 3}
    assert greedy_request("vllm", [5], 1, model="m", top_logprobs=3)[1] == {
        "model": "m", "prompt": [5], "max_tokens": 1, "temperature": 0.0, "logprobs": 3,
        "return_tokens_as_token_ids": True}
    with pytest.raises(EyasError, match="engine 'tgi': expected sglang or vllm"):
        greedy_request("tgi", [5], 1)


def test_reply_ids():
    assert reply_ids("sglang", {"output_ids": [7, 8]}) == [7, 8]
    assert reply_ids("vllm", {"choices": [{"token_ids": [7]}]}) == [7]
    assert reply_ids("sglang", {"text": ""}) is None and reply_ids("vllm", {"choices": []}) is None


def test_retrying_doubles_its_wait_up_to_the_cap_and_raises_the_last(monkeypatch):
    waits, told = [], []
    monkeypatch.setattr(serving.time, "sleep", waits.append)
    calls = []

    def flaky(k):
        calls.append(k)
        if k < 3:
            raise TimeoutError(f"attempt {k}")
        return "ok"
    assert retrying(flaky, retries=5, backoff=0.5, max_backoff=1.5, slept=told.append) == "ok"
    assert calls == [0, 1, 2, 3] and waits == told == [0.5, 1.0, 1.5]

    waits.clear()
    with pytest.raises(TimeoutError, match="attempt 2"):
        retrying(flaky, retries=2, backoff=0.1, max_backoff=5)
    assert waits == [0.1, 0.2]                      # no wait after the last attempt

    def refused(k):
        raise KeyError(k)
    with pytest.raises(KeyError):
        retrying(refused, retries=3, backoff=0.1, max_backoff=5, retry_on=TimeoutError)
    assert waits == [0.1, 0.2]                      # not a retry_on exception: raised at once


@contextmanager
def loopback(routes):
    """A server answering GET/POST `path` with routes[path] = (status, body text, seconds to wait first)."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self):
            if self.command == "POST":
                self.rfile.read(int(self.headers["Content-Length"]))
            code, text, wait = routes.get(self.path, (404, '{"detail": "Not Found"}', 0))
            time.sleep(wait)
            data = text.encode()
            try:
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass

        do_GET = do_POST = _answer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_client_answers_and_each_failure_names_the_flag_url_and_request():
    routes = {"/info": (200, '{"a": 1}', 0), "/metrics": (200, "x 1\n", 0), "/boom": (500, "it\n broke", 0),
              "/html": (200, "<html>", 0), "/slow": (200, "{}", 1.0), "/new": (200, '{"b": 2}', 0)}
    with loopback(routes) as url:
        c = Client(url + "/", timeout=0.3, flag="--url", timeout_flag="--request-timeout")
        assert c.call("GET", "/info") == {"a": 1} and c.call("POST", "/info", {"x": 1}) == {"a": 1}
        assert c.call("GET", "/metrics", text=True) == "x 1\n"
        assert c.call("GET", "/gone", missing_ok=True) is None
        assert c.first(("/gone", "/new")) == {"b": 2} and c.first(("/info", "/new")) == {"a": 1}
        for path, kind, reason in (("/boom", STATUS, "HTTP 500: it broke"),
                                   ("/html", NOT_JSON, "the answer is not JSON"),
                                   ("/slow", TIMEOUT, "no answer within 0.3 s (--request-timeout)"),
                                   ("/gone", STATUS, 'HTTP 404: {"detail": "Not Found"}')):
            with pytest.raises(ServerError) as e:
                c.call("GET", path)
            assert (e.value.kind, str(e.value)) == (kind, f"--url {url}{path}: {reason}")
        assert e.value.status == 404 and "Not Found" in e.value.text
        with pytest.raises(ServerError, match=r"^--url .*/gone: HTTP 404"):
            c.first(("/missing", "/gone"))                # the last path's failure is raised
        assert c.send("GET", "/boom").status_code == 500  # send: any status, no error
        assert post_json(url + "/info", {"x": 1}, 5) == {"a": 1} and get_json(url + "/info", 5) == {"a": 1}
        with pytest.raises(ServerError, match=r"^http://127\.0\.0\.1:\d+/boom: HTTP 500: it broke$"):
            post_json(url + "/boom", {}, 5)
        c.close()

    with socket.socket() as s:                            # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError, match=r"^--plain-url http://127\.0\.0\.1:\d+/v1/models: connection refused "
                                          r"\(is the server up\?\)$") as e:
        Client(f"http://127.0.0.1:{port}", timeout=2, flag="--plain-url").call("GET", "/v1/models")
    assert e.value.kind == REFUSED and e.value.cause is not None


def test_importing_serving_imports_no_http_library():
    """A foundation: stages and the in-server hook's modules may import it without httpx being loaded."""
    code = "import sys, eyas.serving; print(sorted(m for m in sys.modules if m.split('.')[0] in ('httpx', 'torch')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-2000:]
