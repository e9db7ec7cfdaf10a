"""The prepare stage: train split only, counts, limit, fingerprint refusal, resume after kill -9."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_tiny_llama
from test_chat_masks import make_tokenizer

from eyas.data.chat import tokenize_conversation
from eyas.data.prepare import PrepareConfig, run_prepare
from eyas.data.prepared import PROGRESS, SAMPLES, PreparedData
from eyas.data.sources import SkipLog, iter_conversations
from eyas.data.split import is_heldout
from eyas.errors import EyasError
from eyas.target import target_from_model

WORDS = "the quick brown fox jumps over lazy dog hello there paris capital france code return".split()


def write_data(path: Path, n: int, bad_every: int = 0) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            if bad_every and i % bad_every == 3:
                f.write("{broken\n")
                continue
            k = 1 + i % 3
            msgs = []
            for t in range(k):
                msgs.append({"role": "user", "content": " ".join(WORDS[(i + t + j) % len(WORDS)] for j in range(3 + i % 5))})
                msgs.append({"role": "assistant", "content": " ".join(WORDS[(i * 7 + t + j) % len(WORDS)] for j in range(2 + i % 7))})
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return path


def tiny_target(tok, name="tiny"):
    return target_from_model(make_tiny_llama(vocab=len(tok)), tok, name=name)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_prepare_writes_exactly_the_train_split(tmp_path, tok):
    data = write_data(tmp_path / "d.jsonl", 300, bad_every=50)
    target = tiny_target(tok)
    m = run_prepare(PrepareConfig(target="tiny", data=str(data), out=str(tmp_path / "p"), max_len=120,
                                  heldout_fraction=0.2, batch_size=7), target, progress=False)
    # naive reference: every valid, non-held-out conversation tokenized on its own
    ref, untrainable, truncated = [], 0, 0
    for c in iter_conversations(str(data), SkipLog(stream=io.StringIO())):
        if not is_heldout(c.split_key, 0.2):
            t = tokenize_conversation(tok, c.messages, max_len=120)
            if any(t.loss_mask):
                ref.append((c.id, t.input_ids, t.loss_mask))
                truncated += t.truncated
            else:
                untrainable += 1
    got = [(s.id, s.input_ids, s.loss_mask) for s in PreparedData(tmp_path / "p", target=target)]
    assert got == ref
    c = m["counts"]
    assert c["read"] == 300 and c["skipped"] == {"malformed JSON": 6}
    assert c["heldout"] == 294 - len(ref) - untrainable > 0 and c["kept"] == len(ref) > 100
    assert c["dropped"] == ({"no trainable tokens": untrainable} if untrainable else {})
    assert c["truncated"] == truncated > 0
    assert c["tokens"] == sum(len(r[1]) for r in ref) and c["trainable_tokens"] == sum(sum(r[2]) for r in ref)
    assert m["heldout_fraction"] == 0.2 and m["target"] == target.fingerprint and m["kind"] == "prepared"
    pd = PreparedData(tmp_path / "p")
    assert pd[5].input_ids == ref[5][1] and pd[-1].id == ref[-1][0] and len(pd) == len(ref)


def test_limit_takes_a_prefix_and_drops_untrainable(tmp_path, tok):
    data = write_data(tmp_path / "d.jsonl", 200)
    target = tiny_target(tok)
    full = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "a")), target, progress=False)
    part = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "b"), limit=37, batch_size=5), target,
                       progress=False)
    assert part["counts"]["kept"] == 37
    a, b = list(PreparedData(tmp_path / "a")), list(PreparedData(tmp_path / "b"))
    assert b == a[:37]
    # a max-len shorter than the system + first user turn leaves nothing trainable: dropped and counted
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "c"), max_len=8), target, progress=False)
    assert m["counts"]["kept"] == 0 and m["counts"]["dropped"]["no trainable tokens"] == full["counts"]["kept"]


def test_reader_refuses_another_target_and_unfinished_dirs(tmp_path, tok):
    data = write_data(tmp_path / "d.jsonl", 20)
    run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p")), tiny_target(tok), progress=False)
    other = target_from_model(make_tiny_llama(vocab=len(tok), layers=5), tok, name="tiny")
    with pytest.raises(EyasError, match=r"target does not match \(config_sha256"):
        PreparedData(tmp_path / "p", target=other)
    with pytest.raises(EyasError, match="use --overwrite"):  # same dir, different config
        run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), max_len=99), tiny_target(tok),
                    progress=False)
    (tmp_path / "p" / "manifest.json").unlink()
    (tmp_path / "p" / PROGRESS).write_text("{}")
    with pytest.raises(EyasError, match="did not finish"):
        PreparedData(tmp_path / "p")


def test_no_chat_template_and_missing_data(tmp_path):
    tok = make_tokenizer()
    tok.chat_template = None
    data = write_data(tmp_path / "d.jsonl", 3)
    with pytest.raises(EyasError, match="no chat template"):
        run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p")), tiny_target(tok), progress=False)
    with pytest.raises(EyasError, match="no such file"):
        run_prepare(PrepareConfig(data=str(tmp_path / "x.jsonl"), out=str(tmp_path / "p")), None)


def test_uncommitted_tail_is_discarded_on_resume(tmp_path, tok):
    data = write_data(tmp_path / "d.jsonl", 60)
    target = tiny_target(tok)
    ref = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "ref"), batch_size=4), target, progress=False)
    out = tmp_path / "p"
    cfg = PrepareConfig(data=str(data), out=str(out), batch_size=4)
    run_prepare(cfg, target, progress=False)
    # fake a crash: drop the manifest, rewind progress to an early commit, leave garbage after it
    lines = (out / SAMPLES).read_bytes().splitlines(keepends=True)
    (out / "manifest.json").unlink()
    committed = b"".join(lines[:5])
    (out / SAMPLES).write_bytes(committed + lines[5][:17])
    consumed = next(i for i, c in enumerate(iter_conversations(str(data))) if c.id == json.loads(lines[4])["id"]) + 1
    state = {"read": consumed, "skipped": {}, "heldout": consumed - 5, "dropped": {}, "truncated": 0, "kept": 5,
             "tokens": sum(len(json.loads(x)["input_ids"]) for x in lines[:5]),
             "trainable_tokens": sum(e - s for x in lines[:5] for s, e in json.loads(x)["trainable"])}
    ident = {"config": cfg.identity(), "target": target.fingerprint}
    (out / PROGRESS).write_text(json.dumps({"identity": ident, "bytes": len(committed), "consumed": consumed,
                                            "state": state}))
    m = run_prepare(cfg, target, progress=False)
    assert (out / SAMPLES).read_bytes() == (tmp_path / "ref" / SAMPLES).read_bytes()
    assert m["counts"] == ref["counts"]


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from conftest import make_tiny_llama
from transformers import AutoTokenizer
from eyas.data.prepare import PrepareConfig, run_prepare
from eyas.target import target_from_model
tok = AutoTokenizer.from_pretrained({tokdir!r})
target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
run_prepare(PrepareConfig(data={data!r}, out={out!r}, batch_size=3, max_len=256), target, progress=False)
"""


def test_kill_9_then_resume_equals_uninterrupted(tmp_path, tok):
    from transformers import AutoTokenizer

    tokdir = tmp_path / "tok"
    tok.save_pretrained(tokdir)
    tok2 = AutoTokenizer.from_pretrained(tokdir)
    data = write_data(tmp_path / "d.jsonl", 4000, bad_every=97)
    target = target_from_model(make_tiny_llama(vocab=len(tok2)), tok2, name="tiny")
    ref = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "ref"), batch_size=3, max_len=256), target,
                      progress=False)
    out = tmp_path / "p"
    script = CHILD.format(tests=str(Path(__file__).parent), tokdir=str(tokdir), data=str(data), out=str(out))
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and child.poll() is None:
        p = out / PROGRESS
        if p.exists():
            try:
                if json.loads(p.read_text())["state"]["kept"] > 300:
                    break
            except (ValueError, KeyError):
                pass
        time.sleep(0.005)
    assert child.poll() is None, "the child finished before it could be killed; make the data larger"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not (out / "manifest.json").exists()
    killed_at = json.loads((out / PROGRESS).read_text())["state"]["kept"]
    assert 0 < killed_at < ref["counts"]["kept"]
    m = run_prepare(PrepareConfig(data=str(data), out=str(out), batch_size=3, max_len=256), target, progress=False)
    assert (out / SAMPLES).read_bytes() == (tmp_path / "ref" / SAMPLES).read_bytes()
    assert m["counts"] == ref["counts"]
    ids = [s.id for s in PreparedData(out, target=target)]
    assert len(ids) == len(set(ids)) == ref["counts"]["kept"]


@pytest.mark.slow
def test_smollm2_on_20_sharegpt_conversations(tmp_path):
    from eyas.target import load_target

    target = load_target("smollm2-135m")
    m = run_prepare(PrepareConfig(data="sharegpt", out=str(tmp_path / "p"), limit=20), target, progress=False)
    assert m["counts"]["kept"] == 20
    convs = {c.id: c for c in iter_conversations("sharegpt", SkipLog(stream=io.StringIO()))}
    tok = target.tokenizer
    checked = 0
    for s in PreparedData(tmp_path / "p", target=target):
        c = convs[s.id]
        assert not is_heldout(c.split_key)
        if len(s.input_ids) < 2048:  # untruncated: masked runs are exactly the replies + <|im_end|>
            runs, cur = [], []
            for i, mk in zip(s.input_ids, s.loss_mask):
                if mk:
                    cur.append(i)
                elif cur:
                    runs.append(tok.decode(cur))
                    cur = []
            runs += [tok.decode(cur)] if cur else []
            assert runs == [x["content"] + "<|im_end|>" for x in c.messages if x["role"] == "assistant"]
            checked += 1
    assert checked >= 10
