"""Bad input of eyas run, prepare and train, each refused (or counted) with one line naming the knob, file or
record: a --set value that is no finite number, a --set draft vocabulary larger than the target's, a training max_len
shorter than the chat template's framing, a sampled-reply count of 0 under eyas run, and a regeneration server
(a real loopback HTTP server) whose replies are empty, null or only an end-of-turn token."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.models import make_tiny_llama
from test_chat_masks import make_tokenizer

from eyas.cli import main
from eyas.data.chat import encode_prompt, first_turn_framing
from eyas.errors import EyasError
from eyas.recipes import load_recipe
from eyas.run import RunConfig, resolve_stages
from eyas.target import target_from_model


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tok):
    """A tiny HF target directory (ChatML template with a default system prompt) and a few conversations."""
    root = tmp_path_factory.mktemp("issue12")
    make_tiny_llama(vocab=len(tok), max_pos=512).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    with open(root / "chats.jsonl", "w") as f:
        for i in range(12):
            msgs = [{"role": "user", "content": f"hello there {i}"}, {"role": "assistant", "content": "the quick fox"},
                    {"role": "user", "content": "and paris?"}, {"role": "assistant", "content": "return 42"}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return root


def run_args(root, out, *sets):
    args = ["run", "--target", str(root / "target"), "--data", str(root / "chats.jsonl"), "--preset", "cpu-demo",
            "--out", str(out), "--quiet", "--until", "prepare"]
    for s in ("prepare.regenerate=false", "prepare.regenerate_limit=null", "prepare.limit=4", "prepare.heldout_fraction=0.0", *sets):
        args += ["--set", s]
    return args


# ---- 1. a --set value of the wrong type: NaN and infinities are no number any field takes ------------------------

def test_non_finite_numbers_are_refused_naming_the_knob(tmp_path, monkeypatch, capsys):
    import eyas.run

    for key, bad, shown in (("train.lr", float("inf"), "Infinity"), ("train.grad_clip", float("nan"), "NaN"),
                            ("capture.shard_mb", float("inf"), "Infinity"), ("lr", float("-inf"), "-Infinity"),
                            ("prepare.timeout", float("inf"), "Infinity")):
        with pytest.raises(EyasError, match=rf"--set {key}={shown}: expected a finite number for \[\w+\] \w+, "
                                            rf"got {shown}$"):
            RunConfig(preset="cpu-demo", overrides={key: bad})
    with pytest.raises(EyasError, match=r"--set train\.betas=\[0\.9, NaN\]: expected a finite number"):
        RunConfig(preset="cpu-demo", overrides={"train.betas": [0.9, float("nan")]})
    recipe = tmp_path / "r.toml"
    recipe.write_text('[run]\ndevice = "cpu"\n\n[train]\nlr = inf\n')
    with pytest.raises(EyasError, match=rf"^{recipe}: \[train\] lr = Infinity: expected a finite number"):
        load_recipe(recipe)
    # through the CLI: one line, exit 2, before the pipeline starts (JSON's Infinity parses as a float)
    started = []
    monkeypatch.setattr(eyas.run, "run_pipeline", started.append)
    assert main(["run", "--preset", "cpu-demo", "--out", str(tmp_path / "r"), "--set", "train.lr=Infinity"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["eyas run: error: --set train.lr=Infinity: expected a finite number for [train] lr, got Infinity"]
    assert not started
    RunConfig(preset="cpu-demo", overrides={"train.lr": 1e-3, "train.grad_clip": 0})  # finite values still pass


# ---- 2. a draft vocabulary larger than the target's -----------------------------------------------------------

def test_set_draft_vocab_larger_than_the_target_is_refused(tmp_path):
    for key in ("train.draft_vocab", "draft_vocab"):  # the table key and the pre-recipe flat name
        cfg = RunConfig(preset="cpu-demo", target="t", overrides={key: 5000})
        with pytest.raises(EyasError, match=rf"^--set {key}=5000: larger than the target's vocabulary "
                                            rf"\(100 tokens of t\); use at most 100$"):
            resolve_stages(cfg, tmp_path, vocab_size=100)
    assert resolve_stages(RunConfig(preset="cpu-demo", overrides={"train.draft_vocab": 100}), tmp_path,
                          vocab_size=100).train.draft_vocab == 100
    # the preset's own value (8192) is capped: a preset serves targets of every vocabulary size
    assert resolve_stages(RunConfig(preset="cpu-demo"), tmp_path, vocab_size=100).train.draft_vocab == 100


def test_set_draft_vocab_larger_than_the_target_fails_before_prepare(target_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(run_args(target_dir, out, "train.draft_vocab=100000")) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "error" in x]
    assert err == [f"eyas run: error: --set train.draft_vocab=100000: larger than the target's vocabulary "
                   f"(320 tokens of {target_dir / 'target'}); use at most 320"]
    assert not (out / "prepared").exists()


# ---- 3. max_len shorter than the template's framing of a first turn ----------------------------------------------

def test_run_prepare_max_len_shorter_than_the_template_is_one_line(target_dir, tmp_path, tok, capsys):
    n = first_turn_framing(tok)
    assert main(run_args(target_dir, tmp_path / "run", "prepare.max_len=50")) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "error" in x]
    assert len(err) == 1 and err[0].startswith("eyas run: error: --max-len 50 is too short for target ")
    assert err[0].endswith(f"{n} tokens (system prompt and user/assistant headers), so no reply token would fit; "
                           f"use --max-len >= {n + 2}")


def test_train_max_len_shorter_than_the_template_is_refused(tmp_path, tok, capsys):
    from eyas.capture.capture import CaptureConfig, run_capture
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import run_train

    target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for i in range(10):
            words = " ".join(["hello there"] * (1 + 3 * (i % 2)))   # odd ids: a longer user turn
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": words},
                                                             {"role": "assistant", "content": "the quick fox"}]}) + "\n")
    run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), max_len=200, heldout_fraction=0.0), target,
                progress=False)
    run_capture(CaptureConfig(out=str(tmp_path / "s"), data=str(tmp_path / "p"), progress=False), target)
    n = first_turn_framing(tok)

    def train(name, max_len, **src):
        return run_train(TrainConfig(out=str(tmp_path / name), target="tiny", max_len=max_len, steps=1,
                                     batch_tokens=256, draft_vocab=64, ttt_steps=2, eval_fraction=0.0,
                                     progress=False, **src), target=target)

    # online and offline alike: refused before any work, naming the knob and the template's framing
    for name, src in (("on", dict(data=str(tmp_path / "p"))), ("off", dict(store=str(tmp_path / "s")))):
        with pytest.raises(EyasError, match=rf"^--max-len 40 is too short for target tiny: .* {n} tokens .* "
                                            rf">= {n + 2}$"):
            train(name, 40, **src)
    # long enough for the framing but not for a user turn: the error still names --max-len
    with pytest.raises(EyasError, match=rf"no trainable \(loss-masked\) tokens within the first --max-len {n + 2} "
                                        rf"tokens of its 10 samples"):
        train("framing", n + 2, data=str(tmp_path / "p"))
    # room for the short user turns only: the long ones are counted and the first is named, not silently kept
    short = len(encode_prompt(tok, [{"role": "user", "content": "hello there"}])) + 2
    capsys.readouterr()
    train("some", short, data=str(tmp_path / "p"))
    assert (f"eyas train: 5 of 10 training samples of {tmp_path / 'p'} have no trainable token within --max-len "
            f"{short} (first: 'c1'); they add no loss") in capsys.readouterr().err


# ---- 4. a sampled-reply count of 0 --------------------------------------------------------------------------------

def test_samples_per_prompt_zero_is_one_line_under_eyas_run():
    for key in ("prepare.samples_per_prompt", "samples_per_prompt"):
        with pytest.raises(EyasError, match=r"^recipe cpu-demo \[prepare\]: --samples-per-prompt must be >= 1, "
                                            r"got 0$"):
            RunConfig(preset="cpu-demo", overrides={key: 0})


# ---- 5. a regeneration server whose replies are empty -------------------------------------------------------------

class EmptyServer(BaseHTTPRequestHandler):
    """OpenAI-compatible chat completions: reply k to a conversation is REPLIES[its first user text][k]."""

    REPLIES = {"hello there 0": ["first reply", "<|im_end|>"],    # an end-of-turn token only, unskipped
               "hello there 1": [""], "hello there 2": [None], "hello there 3": [" <|im_end|>\n"],
               "hello there 4": ["ok one", "ok two"]}

    def log_message(self, *a):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # /v1/models
        self._send({"object": "list", "data": [{"id": "served", "object": "model"}]})

    def do_POST(self):  # /v1/chat/completions
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        k = sum(m["role"] == "assistant" for m in req["messages"])
        replies = self.REPLIES[req["messages"][0]["content"]]
        text = replies[k] if k < len(replies) else "a later reply"
        self._send({"object": "chat.completion", "model": req["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 0 if not text else 2}})


@pytest.fixture
def empty_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), EmptyServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_empty_server_replies_are_counted_reported_and_never_trained(target_dir, tmp_path, tok, empty_server,
                                                                     capsys):
    from eyas.data.prepared import SKIPS, PreparedData

    data = tmp_path / "d.jsonl"
    lines = (target_dir / "chats.jsonl").read_text().splitlines()[:5]
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "p"
    assert main(["prepare", "--target", str(target_dir / "target"), "--data", str(data), "--out", str(out),
                 "--heldout-fraction", "0", "--regenerate", "--server", empty_server, "--retries", "0"]) == 0
    std = capsys.readouterr()
    assert "empty 4" in std.out
    assert [x for x in std.err.splitlines() if x.startswith("eyas prepare:")] == [
        f"eyas prepare: target {target_dir / 'target'} (source: --target)",
        f"eyas prepare: dropped 3 samples (empty regenerated reply 3); 4 regenerated replies were empty (not "
        f"trained on: each conversation is cut before its empty reply); details in {out / SKIPS}"]
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["empty_replies"] == 4 and counts["regenerated_turns"] == 7 and counts["kept"] == 2
    assert counts["dropped"] == {"empty regenerated reply": 3}
    log = [json.loads(x) for x in (out / SKIPS).read_text().splitlines()]
    assert sorted((x["reason"], x["where"]) for x in log) == [
        ("cut at an empty regenerated reply", f"{data} line 1 (id c0)"),
        *[("empty regenerated reply", f"{data} line {i + 1} (id c{i})") for i in (1, 2, 3)]]
    got = {s.id: s for s in PreparedData(out)}
    assert sorted(got) == ["c0", "c4"]

    def trained(s):  # the text of each trainable run
        runs, cur = [], []
        for t, m in zip(s.input_ids, s.loss_mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(tok.decode(cur))
                cur = []
        return runs + ([tok.decode(cur)] if cur else [])
    assert trained(got["c0"]) == ["first reply<|im_end|>"]          # cut before its end-of-turn-only reply
    assert trained(got["c4"]) == ["ok one<|im_end|>", "ok two<|im_end|>"]


class RunOnServer(EmptyServer):
    """Replies with an unskipped end-of-turn after real text, or running on into the next turn."""
    REPLIES = {f"hello there {i}": ["ok one<|im_end|>", "ok two<|im_end|>\n<|im_start|>user\nleaked"]
               for i in range(5)}


def test_server_replies_end_at_their_first_special_token(target_dir, tmp_path, tok):
    """A server reply that keeps its end-of-turn text, or runs on into the next turn, is cut at its first
    special token, as local regeneration ends at eos: no doubled end-of-turn and no leaked next turn is
    trained on."""
    from eyas.data.prepared import PreparedData

    srv = ThreadingHTTPServer(("127.0.0.1", 0), RunOnServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        data = tmp_path / "d.jsonl"
        data.write_text("\n".join((target_dir / "chats.jsonl").read_text().splitlines()[4:5]) + "\n")
        out = tmp_path / "p"
        assert main(["prepare", "--target", str(target_dir / "target"), "--data", str(data), "--out", str(out),
                     "--heldout-fraction", "0", "--regenerate", "--server",
                     f"http://127.0.0.1:{srv.server_address[1]}/v1", "--retries", "0"]) == 0
    finally:
        srv.shutdown()
        srv.server_close()
    (s,) = list(PreparedData(out))
    runs, cur = [], []
    for t, m in zip(s.input_ids + [0], s.loss_mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert runs == ["ok one<|im_end|>", "ok two<|im_end|>"]
    assert "leaked" not in tok.decode(s.input_ids)
