"""Talking to a serving engine over HTTP: SGLang, vLLM, or any OpenAI-compatible server.

The one client of every stage that sends a server requests: regeneration (data/regenerate.py), engine capture and
its probe (engines/client.py, engines/probe.py), the served check (engines/served_check.py) and `bench --engine`
(bench/engine.py). A foundation: stdlib and errors.py only at import; httpx is imported when a request is made.

- Transport: `Client` holds one server (a base URL) and one pooled httpx.Client, which threads may share;
  `post_json` / `get_json` send one request to a full URL, the `post(url, body, timeout)` / `get(url, timeout)`
  callables that engine capture and the served check take (tests hand them a fake server instead).
- Failures: a request that gets no usable answer raises `ServerError` saying which request and what went wrong:
  no answer within the timeout (naming the flag that sets it where the caller gives one), connection refused,
  connection dropped, an HTTP error status (with the start of the server's text), an answer that is not JSON. Its
  `kind`, `status`, `text` and `cause` let a caller choose what to retry and how to word it.
- Retries: `retrying` runs an attempt until it returns, waiting `backoff` seconds after the first failure and
  doubling up to `max_backoff`.
- Engine differences: where each engine reports its server arguments (`SERVER_INFO`), a greedy request of token
  ids (`greedy_request`: SGLang's /generate, vLLM's /v1/completions) and the token ids of its reply
  (`reply_ids`).
"""

from __future__ import annotations

import time

from eyas.errors import EyasError

ENGINES = ("sglang", "vllm")
# Where each engine reports the flags it runs with: SGLang's /server_info (/get_server_info before it) holds the
# server args by field name; vLLM's /server_info exists only under VLLM_SERVER_DEV_MODE=1.
SERVER_INFO = {"sglang": ("/server_info", "/get_server_info"), "vllm": ("/server_info?config_format=json",)}
# ServerError kinds
TIMEOUT, REFUSED, DROPPED, STATUS, NOT_JSON = "timeout", "refused", "dropped", "status", "not json"


class ServerError(EyasError):
    """A request that got no usable answer: `where` (the request), `reason` (what went wrong), `kind` (TIMEOUT,
    REFUSED, DROPPED, STATUS, NOT_JSON), and for STATUS the `status` code and the server's `text`; `cause` is the
    transport's own exception."""

    def __init__(self, where: str, kind: str, reason: str, *, status: int | None = None, text: str = "",
                 cause: Exception | None = None):
        super().__init__(f"{where}: {reason}")
        self.where, self.kind, self.reason = where, kind, reason
        self.status, self.text, self.cause = status, text, cause


def _send(send, where: str, timeout: float, timeout_flag: str = ""):
    """send() -> its httpx.Response (any status); transport failures -> ServerError."""
    import httpx  # noqa: PLC0415

    try:
        return send()
    except httpx.TimeoutException as e:
        flag = f" ({timeout_flag})" if timeout_flag else ""
        raise ServerError(where, TIMEOUT, f"no answer within {timeout:g} s{flag}", cause=e) from None
    except httpx.ConnectError as e:
        raise ServerError(where, REFUSED, "connection refused (is the server up?)", cause=e) from None
    except httpx.TransportError as e:
        raise ServerError(where, DROPPED, f"the server dropped the connection ({type(e).__name__})",
                          cause=e) from None


def _answer(r, where: str, *, text: bool = False, missing_ok: bool = False):
    """The body of a response: JSON (text=True: the text); an HTTP error status or a body that is not JSON ->
    ServerError; missing_ok: a 404 is None."""
    if missing_ok and r.status_code == 404:
        return None
    if r.status_code >= 400:
        raise ServerError(where, STATUS, f"HTTP {r.status_code}: {' '.join(r.text.split())[:200]}",
                          status=r.status_code, text=r.text)
    if text:
        return r.text
    try:
        return r.json()
    except ValueError:
        raise ServerError(where, NOT_JSON, "the answer is not JSON") from None


def post_json(url: str, body: dict, timeout: float):
    """POST `body` as JSON to `url` -> the JSON answer (one request, on a connection of its own)."""
    import httpx  # noqa: PLC0415

    return _answer(_send(lambda: httpx.post(url, json=body, timeout=timeout), url, timeout), url)


def get_json(url: str, timeout: float):
    """GET `url` -> the JSON answer (one request, on a connection of its own)."""
    import httpx  # noqa: PLC0415

    return _answer(_send(lambda: httpx.get(url, timeout=timeout), url, timeout), url)


class Client:
    """One server: requests to paths under its base `url` through one pooled httpx.Client.

    timeout: seconds a request may take (connect_timeout: to connect, default the same); max_connections: at
    most that many open at once (None: no bound). flag / timeout_flag: the command-line flags that set the URL
    and the timeout, named in errors (`--url http://host:30000/generate: no answer within 5 s
    (--request-timeout)`). http: an httpx.Client to send through instead of one of its own."""

    def __init__(self, url: str, *, timeout: float, connect_timeout: float | None = None,
                 max_connections: int | None = None, flag: str = "", timeout_flag: str = "", http=None):
        import httpx  # noqa: PLC0415

        self.url, self.timeout, self.flag, self.timeout_flag = url.rstrip("/"), timeout, flag, timeout_flag
        self.http = http or httpx.Client(
            timeout=httpx.Timeout(timeout, connect=timeout if connect_timeout is None else connect_timeout),
            limits=httpx.Limits(max_connections=max_connections))

    def where(self, path: str) -> str:
        """How errors name a request to `path`: the flag that gave the URL, then the URL."""
        return f"{self.flag} {self.url}{path}" if self.flag else f"{self.url}{path}"

    def send(self, method: str, path: str, body: dict | None = None):
        """The httpx.Response to one request, whatever its status; transport failures -> ServerError."""
        return _send(lambda: self.http.request(method, self.url + path, json=body), self.where(path), self.timeout,
                     self.timeout_flag)

    def call(self, method: str, path: str, body: dict | None = None, *, text: bool = False,
             missing_ok: bool = False):
        """The JSON answer to one request (text=True: its text; missing_ok: None for a 404); any failure ->
        ServerError."""
        return _answer(self.send(method, path, body), self.where(path), text=text, missing_ok=missing_ok)

    def first(self, paths) -> dict:
        """The JSON answer of the first of `paths` (GET) the server has: a 404 tries the next; the last one's
        failure is raised."""
        *earlier, last = paths
        for path in earlier:
            found = self.call("GET", path, missing_ok=True)
            if found is not None:
                return found
        return self.call("GET", last)

    def close(self) -> None:
        self.http.close()


def retrying(attempt, *, retries: int, backoff: float, max_backoff: float, retry_on=(Exception,), slept=None):
    """attempt(k) for k = 0, 1, ..., retries until one returns, its result. An exception of `retry_on` is retried
    after min(backoff * 2**k, max_backoff) seconds (k: the failed attempt), the last one raised; slept(delay) is
    told of each wait before it is taken."""
    k = 0
    while True:
        try:
            return attempt(k)
        except retry_on:
            if k >= retries:
                raise
        delay = min(backoff * 2 ** k, max_backoff)
        if slept is not None:
            slept(delay)
        time.sleep(delay)
        k += 1


def greedy_request(engine: str, ids, max_new_tokens: int, *, model: str | None = None, rid: str | None = None,
                   stop=None, token_ids: bool = False, top_logprobs: int = 0) -> tuple[str, dict]:
    """(path, body) of a greedy request that continues the token ids `ids` by at most `max_new_tokens`: SGLang's
    native /generate, vLLM's /v1/completions with the served `model` name. rid: the request id the engine's
    hooks and files carry (SGLang rid, vLLM request_id); stop: token ids that end the reply; token_ids: vLLM sends
    the reply's token ids (SGLang always does); top_logprobs: the k likeliest tokens of each step with their
    log-probabilities (vLLM spells them "token_id:ID")."""
    if engine == "sglang":
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        if stop is not None:
            params["stop_token_ids"] = list(stop)
        body = {"input_ids": list(ids), "sampling_params": params}
        if rid is not None:
            body["rid"] = rid
        if top_logprobs:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs)
        return "/generate", body
    if engine not in ENGINES:
        raise EyasError(f"engine {engine!r}: expected sglang or vllm")
    body = {"model": model, "prompt": list(ids), "max_tokens": max_new_tokens, "temperature": 0.0}
    if stop is not None:
        body["stop_token_ids"] = list(stop)
    if token_ids:
        body["return_token_ids"] = True
    if top_logprobs:
        body.update(logprobs=top_logprobs, return_tokens_as_token_ids=True)
    if rid is not None:
        body["request_id"] = rid
    return "/v1/completions", body


def reply_ids(engine: str, reply: dict):
    """The token ids of a greedy_request's reply (None when it carries none): SGLang's output_ids, vLLM's
    choices[0].token_ids (there only with token_ids=True)."""
    if engine == "sglang":
        return reply.get("output_ids")
    return ((reply.get("choices") or [{}])[0]).get("token_ids")
