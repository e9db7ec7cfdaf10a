"""Regeneration: local batched generation equals a per-conversation greedy reference; the server
backend retries with backoff against a real loopback HTTP server and names the conversation on failure."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import make_tiny_llama
from test_chat_masks import make_tokenizer

from eyas.data.chat import encode_prompt, tokenize_conversation
from eyas.data.regenerate import LocalBackend, ServerBackend
from eyas.data.sources import Conversation, Skipped
from eyas.errors import EyasError
from eyas.target import target_from_model


def conv(cid, *texts):
    msgs = tuple({"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts))
    return Conversation(cid, msgs, f"test {cid}", cid)


CONVS = [conv("a", "hello there", "old reply", "and paris?", "old 2"),
         conv("b", "the quick brown fox", "x"),
         conv("c", "def main(): return 42", "y", "more", "z", "again", "w")]


def greedy_reference(model, tok, eos, c, max_new):
    """One conversation at a time, one token at a time, full forward each step."""
    msgs = list(c.messages)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        ids = encode_prompt(tok, msgs[:i])
        new = []
        for _ in range(max_new):
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(nxt)
            if nxt in eos:
                break
        msgs[i] = {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)}
    return msgs


@pytest.mark.parametrize("use_runner", [True, False])
def test_local_greedy_matches_reference(use_runner):
    tok = make_tokenizer()
    model = make_tiny_llama(vocab=len(tok), seed=3)
    target = target_from_model(model, tok, name="tiny")
    be = LocalBackend(target, max_len=100, max_new_tokens=12, temperature=0.0, seed=0, batch_size=3,
                      use_runner=use_runner)
    out = be.regenerate(CONVS)
    for c, o in zip(CONVS, out):
        ref = greedy_reference(model, tok, set(be.eos), c, 12)
        if isinstance(o, Skipped):  # an empty reply (eos first) stops the conversation there
            assert o.reason == "empty regenerated reply"
            continue
        assert [m["role"] for m in o.messages] == [m["role"] for m in ref][: len(o.messages)]
        assert list(o.messages) == ref[: len(o.messages)]
        assert [m for m in o.messages if m["role"] == "user"] == [m for m in c.messages if m["role"] == "user"][: len(
            [m for m in o.messages if m["role"] == "user"])]
    assert be.stats.turns >= 3


class Handler(BaseHTTPRequestHandler):
    plan: dict = {}       # conv first-user-text -> list of actions for successive requests
    seen: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "served-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = req["messages"][0]["content"]
        Handler.seen.append((key, time.monotonic(), req))
        actions = Handler.plan.get(key, [])
        action = actions.pop(0) if actions else "ok"
        if action == "500":
            self.send_response(500)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"boom")
            return
        if action == "sleep":
            time.sleep(1.0)
        n_asst = sum(m["role"] == "assistant" for m in req["messages"])
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": f"R{n_asst}:{key}"},
                                        "finish_reason": "stop"}],
                           "usage": {"completion_tokens": 3}}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def server():
    Handler.plan, Handler.seen = {}, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_server_retries_with_backoff(server):
    Handler.plan = {"hello there": ["500", "500"], "the quick brown fox": ["sleep"]}
    be = ServerBackend(server, model=None, max_new_tokens=8, temperature=0.0, seed=0, concurrency=2,
                       timeout=0.3, retries=3, backoff=0.05)
    assert be.model == "served-model"
    out = be.regenerate(CONVS)
    # every assistant turn replaced, turn by turn (reply k saw k earlier replaced replies), user turns kept
    for c, o in zip(CONVS, out):
        first = c.messages[0]["content"]
        assert [m["role"] for m in o.messages] == [m["role"] for m in c.messages]
        replies = [m["content"] for m in o.messages if m["role"] == "assistant"]
        assert replies == [f"R{k}:{first}" for k in range(len(replies))]
        assert [m for m in o.messages if m["role"] == "user"] == [m for m in c.messages if m["role"] == "user"]
    # retries: 2 x 500 then ok for "a"; 1 timeout then ok for "b"; backoff doubled between the two 500s
    a_times = [t for k, t, _ in Handler.seen if k == "hello there"]
    assert len(a_times) == 2 + 2 and a_times[2] - a_times[1] >= 0.1 - 0.01 and a_times[1] - a_times[0] >= 0.05 - 0.01
    assert len([1 for k, _, _ in Handler.seen if k == "the quick brown fox"]) == 2
    assert sorted(be.sleeps) == [0.05, 0.05, 0.1]
    # a later turn sent the earlier regenerated reply, not the original
    req = [r for k, _, r in Handler.seen if k == "def main(): return 42"][-1]
    assert [m["content"] for m in req["messages"] if m["role"] == "assistant"] == ["R0:def main(): return 42",
                                                                                   "R1:def main(): return 42"]
    assert req["model"] == "served-model" and req["max_tokens"] == 8 and req["temperature"] == 0.0


def test_server_exhausted_retries_name_the_conversation(server):
    Handler.plan = {"the quick brown fox": ["500"] * 10}
    be = ServerBackend(server, model="m", max_new_tokens=8, temperature=0.0, seed=0, concurrency=1,
                       timeout=1.0, retries=2, backoff=0.01)
    with pytest.raises(EyasError, match=r"conversation b turn 1: HTTP 500 'boom' after 3 attempts"):
        be.regenerate(CONVS[1:2])


def test_prepare_regenerate_through_server(server, tmp_path):
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData

    tok = make_tokenizer()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": list(c.messages)}) + "\n" for c in CONVS))
    target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), regenerate=True, server=server,
                                  heldout_fraction=0.0, retries=0), target, progress=False)
    assert m["counts"]["regenerated_turns"] == 6 and m["counts"]["kept"] == 3
    s = PreparedData(tmp_path / "p")[0]
    text = tok.decode([i for i, k in zip(s.input_ids, s.loss_mask) if k])
    assert text == "R0:hello there<|im_end|>R1:hello there<|im_end|>"


def test_regenerate_limit_keeps_the_dataset_replies_after_n(tmp_path):
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData

    tok = make_tokenizer()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": list(c.messages)}) + "\n" for c in CONVS))
    model = make_tiny_llama(vocab=len(tok), seed=3)
    target = target_from_model(model, tok, name="tiny")
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), regenerate=True, regenerate_limit=1,
                                  batch_size=2, max_new_tokens=6, heldout_fraction=0.0), target, progress=False)
    got = {s.id: s for s in PreparedData(tmp_path / "p")}
    assert set(got) == {"a", "b", "c"} and m["counts"]["sent_to_regeneration"] == 1
    # "a": the target's replies (the backend itself is checked against a naive reference above)
    ref = LocalBackend(target, max_len=2048, max_new_tokens=6, temperature=0.0, seed=0).regenerate(CONVS[:1])[0]
    assert got["a"].input_ids == tokenize_conversation(tok, ref.messages).input_ids
    assert ref.messages != CONVS[0].messages
    for c in CONVS[1:]:  # "b", "c": the dataset's own replies, untouched
        assert got[c.id].input_ids == tokenize_conversation(tok, c.messages).input_ids
    with pytest.raises(ValueError, match="regenerate-limit"):
        PrepareConfig(data=str(data), out=str(tmp_path / "q"), regenerate_limit=1)
