"""Regeneration: local batched generation equals a per-conversation greedy reference; the server
backend retries with backoff against a real loopback HTTP server and names the conversation on failure."""

import json
from dataclasses import replace
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from support.models import make_tiny_llama
from test_chat_masks import make_tokenizer

from eyas.data.chat import encode_prompt, tokenize_conversation
from eyas.data.regenerate import LocalBackend, RegenConfig, ServerBackend
from eyas.data.sources import Conversation, Skipped
from eyas.errors import EyasError
from eyas.target import target_from_model


def conv(cid, *texts):
    msgs = tuple({"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts))
    return Conversation(cid, msgs, f"test {cid}", cid)


CONVS = [conv("a", "hello there", "old reply", "and paris?", "old 2"),
         conv("b", "the quick brown fox", "x"),
         conv("c", "def main(): return 42", "y", "more", "z", "again", "w")]


def reference(model, tok, eos, c, *, max_new, max_len):
    """The naive reference: one conversation, one turn, one token at a time, a full forward per token.

    The rules of LocalBackend: a turn whose prompt already fills max_len ends the conversation before it;
    a reply stops at eos, max_new tokens or max_len; a reply cut by max_len ends the conversation after it;
    an empty reply ends it before it. Returns the messages kept, or None when no reply is left."""
    msgs = list(c.messages)
    for i in [i for i, m in enumerate(c.messages) if m["role"] == "assistant"]:
        ids = encode_prompt(tok, msgs[:i])
        if len(ids) >= max_len:
            msgs = msgs[:i]
            break
        new = []
        while len(new) < min(max_new, max_len - len(ids)):
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(nxt)
            if nxt in eos:
                break
        text = tok.decode(new, skip_special_tokens=True)
        if not text.strip():
            msgs = msgs[:i]
            break
        msgs[i] = {"role": "assistant", "content": text}
        if new[-1] not in eos and len(new) == max_len - len(ids):
            msgs = msgs[: i + 1]
            break
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
    return msgs[: last + 1] if last >= 0 else None


def test_regen_compile_reaches_the_runner_and_not_the_identity():
    """--regen-compile builds the regeneration runner with a dynamic-shape torch.compile of its decode step (the
    compile itself runs on first use; tests/test_runner.py checks its tokens on CUDA), and, like gen_batch, it is
    a speed knob: the prepared data's identity does not change."""
    from eyas.data.prepare import PrepareConfig
    from eyas.data.regenerate import make_backend

    tok = make_tokenizer()
    target = target_from_model(make_tiny_llama(vocab=len(tok), seed=3), tok, name="tiny")
    cfg = PrepareConfig(target="tiny", out="unused", regenerate=True, max_len=100, regen=RegenConfig(max_new_tokens=8))
    on = replace(cfg, regen=replace(cfg.regen, regen_compile=True))
    assert make_backend(on, target).runner._compiled is not None
    assert make_backend(cfg, target).runner._compiled is None
    assert on.identity() == cfg.identity()


@pytest.mark.parametrize("use_runner", [True, False])
def test_local_greedy_matches_reference(use_runner):
    tok = make_tokenizer()
    model = make_tiny_llama(vocab=len(tok), seed=3)
    target = target_from_model(model, tok, name="tiny")
    # max_len 100: "a" and "c" run out of room (a reply cut by the budget, a later prompt too long)
    be = LocalBackend(target, max_len=100, max_new_tokens=12, temperature=0.0, seed=0, batch_size=3,
                      use_runner=use_runner, gen_batch=2)
    out = be.regenerate(CONVS)
    for c, o in zip(CONVS, out):
        ref = reference(model, tok, set(be.eos), c, max_new=12, max_len=100)
        if ref is None:
            assert isinstance(o, Skipped) and o.reason in ("empty regenerated reply", "prompt longer than max-len")
            continue
        assert list(o.messages) == ref
        assert [m["content"] for m in o.messages if m["role"] == "user"] == \
            [m["content"] for m in c.messages if m["role"] == "user"][: len(ref) // 2]
    assert be.stats.turns >= 3 and be.stats.budget_cut + be.stats.cut >= 1


class Handler(BaseHTTPRequestHandler):
    plan: dict = {}       # conv first-user-text -> list of actions for successive requests
    seen: list = []
    delay = 0.0           # seconds every request takes
    inflight = peak = 0   # requests being answered now, and the most at once
    lock = threading.Lock()

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
        with Handler.lock:
            Handler.inflight += 1
            Handler.peak = max(Handler.peak, Handler.inflight)
        try:
            time.sleep(Handler.delay)
        finally:       # out of flight before the answer is written: the client may send its next request on receipt
            with Handler.lock:
                Handler.inflight -= 1
        self._answer(req)

    def _answer(self, req):
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
        if action == "400":  # as vLLM answers a prompt over its context: the message names this prompt's length
            body = json.dumps({"object": "error", "message": f"The input ({len(key)} tokens) is longer than the "
                                                             f"model's context length (16 tokens)."}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if action == "sleep":
            time.sleep(1.0)
        n_asst = sum(m["role"] == "assistant" for m in req["messages"])
        text = {"empty": "  ", "hello": "Hello<|im_end|>",          # an unskipped end-of-turn
                "runon": "Hi<|im_end|><|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\nWell"
                }.get(action, f"R{n_asst}:{key}")                     # runon: the server ran into the next turn
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
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
    Handler.plan, Handler.seen, Handler.delay, Handler.inflight, Handler.peak = {}, [], 0.0, 0, 0
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
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), regenerate=True, heldout_fraction=0.0,
                                  regen=RegenConfig(server=server, retries=0)), target, progress=False)
    assert m["counts"]["regenerated_turns"] == 6 and m["counts"]["kept"] == 3
    s = PreparedData(tmp_path / "p")[0]
    text = tok.decode([i for i, k in zip(s.input_ids, s.loss_mask) if k])
    assert text == "R0:hello there<|im_end|>R1:hello there<|im_end|>"


def test_prepare_keeps_concurrency_requests_in_flight_past_a_small_batch_size(server, tmp_path):
    """With --server, --concurrency N means N requests in flight, whatever batch_size (the commit group) is: the
    group grows to keep the server busy, and every conversation is still regenerated once and written in order."""
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData

    tok = make_tokenizer()
    convs = [conv(f"c{i}", f"question {i}", "a", f"again {i}", "b") for i in range(24)]
    target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
    Handler.delay = 0.05
    m = run_prepare(PrepareConfig(data=write_jsonl(tmp_path / "d.jsonl", convs), out=str(tmp_path / "p"),
                                  regenerate=True, heldout_fraction=0.0, batch_size=2,
                                  regen=RegenConfig(server=server, retries=0, concurrency=6)), target, progress=False)
    assert Handler.peak == 6, f"at most {Handler.peak} of 6 requests in flight"
    assert m["counts"]["kept"] == 24 and m["counts"]["regenerated_turns"] == 48
    assert [s.id for s in PreparedData(tmp_path / "p")] == [f"c{i}" for i in range(24)]


def test_server_replies_are_cut_at_the_first_special(server, tmp_path):
    """A server that leaves the end-of-turn in its text ("Hello<|im_end|>") or runs on into the next turn
    ("Hi<|im_end|><|im_start|>user..."): the kept reply is the text before the first special token, and the
    stored sample ends each reply with one template end-of-turn, nothing after it."""
    from eyas.data.chat import special_strings
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData

    tok = make_tokenizer()
    assert {"<|im_end|>", "<|im_start|>"} <= set(special_strings(tok))
    Handler.plan = {"hello there": ["hello", "runon"]}
    be = ServerBackend(server, model="m", max_new_tokens=8, temperature=0.0, seed=0, concurrency=1, retries=0,
                       specials=special_strings(tok))
    (out,) = be.regenerate(CONVS[:1])
    assert [m["content"] for m in out.messages] == ["hello there", "Hello", "and paris?", "Hi"]
    Handler.plan = {"hello there": ["hello", "runon"]}
    target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
    run_prepare(PrepareConfig(data=write_jsonl(tmp_path / "d.jsonl", CONVS[:1]), out=str(tmp_path / "p"),
                              regenerate=True, heldout_fraction=0.0, regen=RegenConfig(server=server, retries=0)),
                target, progress=False)
    (s,) = PreparedData(tmp_path / "p")
    assert masked_runs(tok, s) == ["Hello<|im_end|>", "Hi<|im_end|>"]
    assert tok.decode(s.input_ids).count("<|im_start|>user") == 2


def test_regenerate_limit_keeps_the_dataset_replies_after_n(tmp_path):
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData

    tok = make_tokenizer()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": list(c.messages)}) + "\n" for c in CONVS))
    model = make_tiny_llama(vocab=len(tok), seed=3)
    target = target_from_model(model, tok, name="tiny")
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), regenerate=True, batch_size=2,
                                  heldout_fraction=0.0, regen=RegenConfig(regenerate_limit=1, max_new_tokens=6)),
                    target, progress=False)
    got = {s.id: s for s in PreparedData(tmp_path / "p")}
    assert set(got) == {"a", "b", "c"} and m["counts"]["sent_to_regeneration"] == 1
    # "a": the target's replies (the backend itself is checked against a naive reference above)
    ref = LocalBackend(target, max_len=2048, max_new_tokens=6, temperature=0.0, seed=0).regenerate(CONVS[:1])[0]
    assert got["a"].input_ids == tokenize_conversation(tok, ref.messages).input_ids
    assert ref.messages != CONVS[0].messages
    for c in CONVS[1:]:  # "b", "c": the dataset's own replies, untouched
        assert got[c.id].input_ids == tokenize_conversation(tok, c.messages).input_ids
    with pytest.raises(ValueError, match="regenerate-limit"):
        PrepareConfig(data=str(data), out=str(tmp_path / "q"), regen=RegenConfig(regenerate_limit=1))


# --------------------------------------------------------------------------- prepare: multi-turn, samples, magpie

def write_jsonl(path, convs):
    path.write_text("".join(json.dumps({"id": c.id, "messages": list(c.messages)}) + "\n" for c in convs))
    return str(path)


MULTI = [conv("m0", "hello there", "x", "and paris?", "y", "more please", "z", "and more", "w"),
         conv("m1", "the quick brown fox jumps over the lazy dog " * 3, "x"),
         conv("m2", "def main(): return 42", "y", "more", "z"),
         conv("m3", "hi", "x", "capital of france", "y", "code", "z"),
         conv("m4", "speculative decoding drafts tokens; the target verifies them " * 2, "x", "why", "y"),
         conv("m5", "numbers 1234567890", "x", "again", "y", "again", "z"),
         conv("m6", "ok", "x")]


def masked_runs(tok, s):
    runs, cur = [], []
    for i, m in zip(s.input_ids, s.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


@pytest.fixture(scope="module")
def tiny_chat():
    tok = make_tokenizer()
    model = make_tiny_llama(vocab=len(tok), seed=5)
    return tok, model, target_from_model(model, tok, name="tiny")


def test_prepare_multi_turn_regeneration_equals_naive_reference(tmp_path, tiny_chat):
    from eyas.data.prepare import PrepareConfig, first_turns, run_prepare
    from eyas.data.prepared import PreparedData

    tok, model, target = tiny_chat
    data = write_jsonl(tmp_path / "d.jsonl", MULTI)
    # 4 conversations per chunk, 2 rows per forward: turn j of a chunk is one sorted, batched pass
    m = run_prepare(PrepareConfig(data=data, out=str(tmp_path / "p"), regenerate=True, max_turns=3, max_len=160,
                                  batch_size=4, heldout_fraction=0.0,
                                  regen=RegenConfig(max_new_tokens=10, gen_batch=2)), target, progress=False)
    got = {s.id: s for s in PreparedData(tmp_path / "p")}
    eos = set(target.eos_token_ids)
    multi_turn = 0
    for c in MULTI:
        ref = reference(model, tok, eos, first_turns(c, 3), max_new=10, max_len=160)
        if ref is None:
            assert c.id not in got
            continue
        t = tokenize_conversation(tok, ref, max_len=160)
        assert got[c.id].input_ids == t.input_ids and got[c.id].loss_mask == t.loss_mask  # token for token
        replies = [x["content"] + "<|im_end|>" for x in ref if x["role"] == "assistant"]
        if not t.truncated:  # the loss mask covers exactly the regenerated replies (and their end of turn)
            assert masked_runs(tok, got[c.id]) == replies
            multi_turn += len(replies) > 1
    assert multi_turn >= 2 and m["counts"]["regenerated_turns"] > len(MULTI)
    assert m["counts"]["empty_replies"] == 0 and m["counts"]["kept"] == m["counts"]["conversations"] == len(got)


def test_sampled_replies_are_reproducible_and_differ(tmp_path, tiny_chat):
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import SAMPLES, PreparedData
    from eyas.data.split import is_heldout, split_key
    from eyas.train.data import is_eval

    tok, model, target = tiny_chat
    data = write_jsonl(tmp_path / "d.jsonl", MULTI)

    def run(out, seed):
        regen = RegenConfig(max_new_tokens=8, samples_per_prompt=3, regen_temperature=1.0, seed=seed, gen_batch=4)
        return run_prepare(PrepareConfig(data=data, out=str(tmp_path / out), regenerate=True, max_len=160,
                                         batch_size=3, heldout_fraction=0.0, regen=regen), target, progress=False)

    m = run("a", 0)
    run("b", 0)
    run("c", 1)
    a = (tmp_path / "a" / SAMPLES).read_bytes()
    assert a == (tmp_path / "b" / SAMPLES).read_bytes()  # same seed: the same samples
    assert a != (tmp_path / "c" / SAMPLES).read_bytes()  # another seed: other samples
    samples = list(PreparedData(tmp_path / "a"))
    by_conv: dict = {}
    for s in samples:
        base, k = s.id.split("#s")
        by_conv.setdefault(base, []).append((int(k), s.input_ids))
    assert set(by_conv) == {c.id for c in MULTI} - {"m1"}  # m1's first prompt is longer than max-len
    for base, group in by_conv.items():
        ks = [k for k, _ in group]
        assert ks == sorted(ks) and set(ks) <= {1, 2, 3}  # written together, in sample order
        assert len({tuple(ids) for _, ids in group}) == len(group)  # the samples differ
    assert m["counts"]["kept"] == len(samples) > 2 * len(by_conv) and m["counts"]["conversations"] == len(by_conv)
    # every sample of a conversation falls on its side of both splits
    for cid in [f"c{i}" for i in range(300)] + ["abcdefg_3"]:
        ids = [f"{cid}#s{k}" for k in range(1, 4)]
        assert {split_key(i, sharegpt=True) for i in ids} == {split_key(cid, sharegpt=True)}
        assert {is_eval(i, 0.3) for i in ids} == {is_eval(cid, 0.3)}
        assert {is_heldout(split_key(i), 0.3) for i in ids} == {is_heldout(cid, 0.3)}


def test_greedy_sample_is_the_greedy_run_and_the_others_are_sampled(tmp_path, tiny_chat):
    """--greedy-sample: reply set #s1 of every conversation is exactly what a greedy one-sample run writes for it,
    the other sets are sampled (they differ from it), and the knob is part of the data's identity."""
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData
    from eyas.errors import EyasError

    tok, model, target = tiny_chat
    data = write_jsonl(tmp_path / "d.jsonl", MULTI)
    base = dict(data=data, regenerate=True, max_len=160, batch_size=3, heldout_fraction=0.0)
    regen = RegenConfig(max_new_tokens=8, gen_batch=4)
    greedy = run_prepare(PrepareConfig(out=str(tmp_path / "g"), regen=regen, **base), target, progress=False)
    mixed = run_prepare(PrepareConfig(out=str(tmp_path / "m"), regen=replace(regen, samples_per_prompt=3,
                                      regen_temperature=1.0, greedy_sample=True), **base), target, progress=False)
    ref = {s.id: s.input_ids for s in PreparedData(tmp_path / "g")}
    by_conv: dict = {}
    for s in PreparedData(tmp_path / "m"):
        base_id, k = s.id.split("#s")
        by_conv.setdefault(base_id, {})[int(k)] = s.input_ids
    assert set(by_conv) == set(ref) and len(ref) >= 5
    for cid, sets in by_conv.items():
        assert sets[1] == ref[cid], cid  # the greedy set: token for token the greedy run's
    sampled = [ids for sets in by_conv.values() for k, ids in sets.items() if k > 1]
    assert len(sampled) >= len(ref) and sum(ids not in ref.values() for ids in sampled) >= len(sampled) - 1
    assert mixed["identity"]["config"]["regen"]["greedy_sample"] is True
    assert greedy["identity"]["config"]["regen"]["greedy_sample"] is False
    with pytest.raises(EyasError, match="--greedy-sample needs --samples-per-prompt >= 2"):
        replace(regen, greedy_sample=True, regen_temperature=1.0)


def test_regen_fuse_writes_the_same_data_through_fused_layers(tmp_path, tiny_chat):
    """--regen-fuse: regeneration decodes through the runner's compiled layer pieces (Runner.from_hf fuse=True) and
    writes the samples the eager runner writes; with --regen-compile it is refused in one line."""
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import SAMPLES
    from eyas.data.regenerate import make_backend
    from eyas.errors import EyasError

    tok, model, target = tiny_chat
    data = write_jsonl(tmp_path / "d.jsonl", MULTI)
    base = dict(data=data, regenerate=True, max_len=160, batch_size=3, heldout_fraction=0.0)
    eager = RegenConfig(max_new_tokens=8, gen_batch=4)
    fused = replace(eager, regen_fuse=True)
    run_prepare(PrepareConfig(out=str(tmp_path / "e"), regen=eager, **base), target, progress=False)
    m = run_prepare(PrepareConfig(out=str(tmp_path / "f"), regen=fused, **base), target, progress=False)
    assert (tmp_path / "f" / SAMPLES).read_bytes() == (tmp_path / "e" / SAMPLES).read_bytes()
    assert m["counts"]["regenerated_turns"] > 5 and "regen_fuse" not in m["identity"]["config"]["regen"]
    backend = make_backend(PrepareConfig(out=str(tmp_path / "x"), regen=fused, **base), target)
    assert all(layer.fused for layer in backend.runner.layers)
    with pytest.raises(EyasError, match="--regen-fuse compiles the layers' pieces"):
        replace(fused, regen_compile=True)


def test_self_prompts_make_well_formed_conversations(tmp_path, tiny_chat):
    from eyas.data.chat import user_header
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData

    tok, model, target = tiny_chat
    data = write_jsonl(tmp_path / "d.jsonl", MULTI[2:4])
    cfg = PrepareConfig(data=data, out=str(tmp_path / "p"), max_len=160, batch_size=4, heldout_fraction=0.0,
                        regen=RegenConfig(self_prompts=6, max_new_tokens=12, seed=7))
    m = run_prepare(cfg, target, progress=False)
    got = {s.id: s for s in PreparedData(tmp_path / "p")}
    assert {"m2", "m3"} <= set(got)  # the dataset's own replies (no --regenerate), then the self-prompts
    # the same calls, one by one: the target's user turns from the header, then greedy replies (naive reference)
    be = LocalBackend(target, max_len=160, max_new_tokens=12, temperature=0.0, seed=7, batch_size=4)
    prompts = be.self_prompts(0, 4, 1.0) + be.self_prompts(4, 2, 1.0)
    header = user_header(tok)
    assert tok.decode(header).endswith("<|im_start|>user\n")
    n_magpie = 0
    for j, p in enumerate(prompts):
        assert p.id == f"magpie-{j}"
        if isinstance(p, Skipped):
            assert p.reason == "empty self-prompt" and p.id not in got
            continue
        user = p.messages[0]["content"]
        assert [x["role"] for x in p.messages] == ["user", "assistant"] and user == user.strip() and user
        assert not any(sp in user for sp in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
        ref = reference(model, tok, set(be.eos), p, max_new=12, max_len=160)
        if ref is None:
            assert p.id not in got
            continue
        t = tokenize_conversation(tok, ref, max_len=160)
        s = got[p.id]
        assert s.input_ids == t.input_ids and s.loss_mask == t.loss_mask
        assert s.input_ids[: len(header)] == header and not any(s.loss_mask[: len(header)])
        n_magpie += 1
    assert n_magpie >= 3 and m["counts"]["self_prompts_written"] == 6 and m["counts"]["self_prompts_done"] == 6
    assert len({got[f"magpie-{j}"].input_ids[len(header):][:5].__repr__() for j in range(6)
                if f"magpie-{j}" in got}) == n_magpie  # sampled: the prompts differ


def test_empty_local_replies_are_counted_and_never_trained(tmp_path, capsys):
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import SKIPS

    tok = make_tokenizer()
    model = make_tiny_llama(vocab=len(tok), seed=3)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits tie: argmax is id 0, <|endoftext|>, an end of turn
    target = target_from_model(model, tok, name="tiny")
    convs = [c for c in MULTI if c.id != "m1"]  # m1's prompt is longer than max-len
    data = write_jsonl(tmp_path / "d.jsonl", convs)
    m = run_prepare(PrepareConfig(data=data, out=str(tmp_path / "p"), regenerate=True, max_len=160,
                                  heldout_fraction=0.0), target, progress=False)
    c = m["counts"]
    assert c["kept"] == 0 and c["empty_replies"] == c["regenerated_turns"] == len(convs) == 6
    assert c["dropped"] == {"empty regenerated reply": 6}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "6 regenerated replies were empty" in err[0] and "dropped 6 samples" in err[0]
    log = [json.loads(x) for x in (tmp_path / "p" / SKIPS).read_text().splitlines()]
    assert [x["reason"] for x in log] == ["empty regenerated reply"] * 6 and "d.jsonl line 1" in log[0]["where"]


def test_server_empty_replies_cut_the_conversation(server, tmp_path, capsys):
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import SKIPS, PreparedData

    tok = make_tokenizer()
    data = write_jsonl(tmp_path / "d.jsonl", CONVS)
    target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
    Handler.plan = {"hello there": ["ok", "empty"], "the quick brown fox": ["empty"]}
    m = run_prepare(PrepareConfig(data=data, out=str(tmp_path / "p"), regenerate=True, heldout_fraction=0.0,
                                  regen=RegenConfig(server=server, retries=0)), target, progress=False)
    c = m["counts"]
    assert c["empty_replies"] == 2 and c["dropped"] == {"empty regenerated reply": 1} and c["kept"] == 2
    got = {s.id: s for s in PreparedData(tmp_path / "p")}
    assert masked_runs(tok, got["a"]) == ["R0:hello there<|im_end|>"]  # cut before its empty second reply
    assert "b" not in got
    reasons = sorted(json.loads(x)["reason"] for x in (tmp_path / "p" / SKIPS).read_text().splitlines())
    assert reasons == ["cut at an empty regenerated reply", "empty regenerated reply"]
    assert "2 regenerated replies were empty" in capsys.readouterr().err


def test_server_rejections_are_counted_by_status_with_the_message_in_the_skip_log(server, tmp_path):
    """Two prompts refused with HTTP 400, each with its own message: one reason in the counts (not one per
    message), and each skipped record keeps the server's message."""
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import SKIPS

    tok = make_tokenizer()
    data = write_jsonl(tmp_path / "d.jsonl", CONVS)
    target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
    Handler.plan = {"hello there": ["400"], "the quick brown fox": ["400"]}
    m = run_prepare(PrepareConfig(data=data, out=str(tmp_path / "p"), regenerate=True, heldout_fraction=0.0,
                                  regen=RegenConfig(server=server, retries=0)), target, progress=False)
    assert m["counts"]["dropped"] == {"server rejected: HTTP 400": 2} and m["counts"]["kept"] == 1
    skips = [json.loads(x) for x in (tmp_path / "p" / SKIPS).read_text().splitlines()]
    details = sorted(x["detail"] for x in skips if x["reason"] == "server rejected: HTTP 400")
    assert len(details) == 2 and all("is longer than the model's context length" in d for d in details)
    assert "(11 tokens)" in details[0] + details[1] and "(19 tokens)" in details[0] + details[1]
