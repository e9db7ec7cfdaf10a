"""The prepare stage: train split only, counts, limit, fingerprint refusal, resume after kill -9."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.models import make_tiny_llama
from test_chat_masks import make_tokenizer

from eyas.data.chat import first_turn_framing, tokenize_conversation
from eyas.data.prepare import PrepareConfig, run_prepare
from eyas.data.prepared import PROGRESS, SAMPLES, SKIPS, VERSION, PreparedData
from eyas.data.regenerate import RegenConfig
from eyas.data.sources import SkipLog, iter_conversations
from eyas.data.split import is_heldout
from eyas.errors import EyasError
from eyas.knobs import from_knobs
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


def tiny_chat_target(tok, name="tiny"):
    return target_from_model(make_tiny_llama(vocab=len(tok)), tok, name=name)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_prepare_writes_exactly_the_train_split(tmp_path, tok):
    data = write_data(tmp_path / "d.jsonl", 300, bad_every=50)
    target = tiny_chat_target(tok)
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
    target = tiny_chat_target(tok)
    full = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "a")), target, progress=False)
    part = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "b"), limit=37, batch_size=5), target,
                       progress=False)
    assert part["counts"]["kept"] == 37
    a, b = list(PreparedData(tmp_path / "a")), list(PreparedData(tmp_path / "b"))
    assert b == a[:37]
    # a max-len that holds the template's framing but not the first user turns leaves nothing trainable:
    # dropped and counted
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "c"), max_len=first_turn_framing(tok) + 2),
                    target, progress=False)
    assert m["counts"]["kept"] == 0 and m["counts"]["dropped"]["no trainable tokens"] == full["counts"]["kept"]


def test_reader_refuses_another_target_and_unfinished_dirs(tmp_path, tok):
    data = write_data(tmp_path / "d.jsonl", 20)
    run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p")), tiny_chat_target(tok), progress=False)
    other = target_from_model(make_tiny_llama(vocab=len(tok), layers=5), tok, name="tiny")
    with pytest.raises(EyasError, match=r"target does not match \(config\.num_hidden_layers: 4 != 5"):
        PreparedData(tmp_path / "p", target=other)
    with pytest.raises(EyasError, match="use --overwrite"):  # same dir, different config
        run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), max_len=99), tiny_chat_target(tok),
                    progress=False)
    (tmp_path / "p" / "manifest.json").unlink()
    (tmp_path / "p" / PROGRESS).write_text("{}")
    with pytest.raises(EyasError, match="did not finish"):
        PreparedData(tmp_path / "p")


def test_a_prepared_directory_of_another_version_is_refused_in_one_line(tmp_path, tok):
    """A manifest.json or progress.json of another prepared-data version (none recorded: an older eyas's) is not
    read: the reader, a rerun and a resume refuse it in one line naming the file and the way out."""
    from dataclasses import replace

    data = write_data(tmp_path / "d.jsonl", 20)
    target = tiny_chat_target(tok)
    cfg = PrepareConfig(data=str(data), out=str(tmp_path / "p"))
    ref = run_prepare(cfg, target, progress=False)
    assert ref["version"] == VERSION

    def refused(path, got):
        return rf"^{re.escape(str(path))}: prepared-data version {got}, this eyas reads version {VERSION}; prepare " \
               rf"the data again \(eyas prepare --overwrite, or eyas run --overwrite\)$"

    manifest = tmp_path / "p" / "manifest.json"
    old = {k: v for k, v in json.loads(manifest.read_text()).items() if k != "version"}
    manifest.write_text(json.dumps(old))
    with pytest.raises(EyasError, match=refused(manifest, 1)):
        PreparedData(tmp_path / "p", target=target)
    with pytest.raises(EyasError, match=refused(manifest, 1)):
        run_prepare(cfg, target, progress=False)
    # an interrupted directory: its progress.json
    manifest.unlink()
    progress = tmp_path / "p" / PROGRESS
    progress.write_text(json.dumps({"version": VERSION + 1, "identity": old["identity"], "bytes": 0, "log_bytes": 0,
                                    "consumed": 0, "state": {}}))
    with pytest.raises(EyasError, match=refused(progress, VERSION + 1)):
        run_prepare(cfg, target, progress=False)
    # --overwrite prepares it again
    again = run_prepare(replace(cfg, overwrite=True), target, progress=False)
    assert again["files"] == ref["files"] and len(PreparedData(tmp_path / "p", target=target)) == ref["counts"]["kept"]


def test_no_chat_template_and_missing_data(tmp_path):
    tok = make_tokenizer()
    tok.chat_template = None
    data = write_data(tmp_path / "d.jsonl", 3)
    with pytest.raises(EyasError, match="no chat template"):
        run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p")), tiny_chat_target(tok), progress=False)
    with pytest.raises(EyasError, match="no such file"):
        run_prepare(PrepareConfig(data=str(tmp_path / "x.jsonl"), out=str(tmp_path / "p")), None)


def test_uncommitted_tail_is_discarded_on_resume(tmp_path, tok):
    data = write_data(tmp_path / "d.jsonl", 60)
    target = tiny_chat_target(tok)
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
             "conversations": 5,
             "tokens": sum(len(json.loads(x)["input_ids"]) for x in lines[:5]),
             "trainable_tokens": sum(e - s for x in lines[:5] for s, e in json.loads(x)["trainable"])}
    ident = {"config": cfg.identity(), "target": target.fingerprint}
    (out / PROGRESS).write_text(json.dumps({"version": VERSION, "identity": ident, "bytes": len(committed),
                                            "log_bytes": 0, "consumed": consumed, "state": state}))
    m = run_prepare(cfg, target, progress=False)
    assert (out / SAMPLES).read_bytes() == (tmp_path / "ref" / SAMPLES).read_bytes()
    assert m["counts"] == ref["counts"]


def test_bad_input_is_one_clear_error(tmp_path, tok, capsys):
    from eyas.cli import main

    data = str(write_data(tmp_path / "d.jsonl", 5))
    out = str(tmp_path / "p")
    for kw, msg in [(dict(samples_per_prompt=0), "--samples-per-prompt must be >= 1, got 0"),
                    (dict(samples_per_prompt=2, regen_temperature=1.0), "needs --regenerate"),
                    (dict(samples_per_prompt=2, regenerate=True), "needs --regen-temperature > 0"),
                    (dict(self_prompts=-1), "--self-prompts must be >= 0"),
                    (dict(self_prompts=2, regenerate=True, server="http://x"), "needs local generation"),
                    (dict(self_prompts=2, self_prompt_temperature=0.0), "--self-prompt-temperature must be > 0")]:
        with pytest.raises(ValueError, match=msg):   # the flat knobs, as the flags and a recipe give them
            from_knobs(PrepareConfig, dict(data=data, out=out, **kw))
    assert main(["prepare", "--data", data, "--out", out, "--regenerate", "--samples-per-prompt", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["eyas prepare: error: --samples-per-prompt must be >= 1, got 0"]
    # max_len shorter than the template's framing of a first turn (82 tokens here: the default system prompt)
    n = first_turn_framing(tok)
    with pytest.raises(EyasError, match=rf"--max-len 50 is too short for target tiny: .* {n} tokens .* >= {n + 2}$"):
        run_prepare(PrepareConfig(data=data, out=out, max_len=50), tiny_chat_target(tok), progress=False)


def test_skipped_records_are_one_summary_line_with_details_in_a_log(tmp_path, tok, capsys):
    data = write_data(tmp_path / "d.jsonl", 60, bad_every=10)
    with open(data, "a") as f:
        f.write(json.dumps({"id": "r", "messages": [{"role": "bot", "content": "x"}]}) + "\n")
        for i in range(4):
            f.write(json.dumps({"id": f"e{i}", "messages": [{"role": "user", "content": " "},
                                                            {"role": "assistant", "content": "y"}]}) + "\n")
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "p"), heldout_fraction=0.0), tiny_chat_target(tok),
                    progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"eyas prepare: skipped 11 of 65 records (empty turn 4, malformed JSON 6, unknown role 1); "
                   f"details in {tmp_path / 'p' / SKIPS}"]
    log = [json.loads(x) for x in (tmp_path / "p" / SKIPS).read_text().splitlines()]
    assert [x["where"] for x in log if x["reason"] == "malformed JSON"] == [f"{data} line {i}" for i in range(4, 60, 10)]
    assert [x["where"] for x in log if x["reason"] == "empty turn"] == [f"{data} line {62 + i} (id e{i})" for i in range(4)]
    assert len(log) == 11 and m["files"][SKIPS]["bytes"] == (tmp_path / "p" / SKIPS).stat().st_size


@pytest.mark.parametrize("greedy_sample", [False, True])  # all sets sampled / #s1 greedy (a call of its own)
@pytest.mark.parametrize("crash_at", [2, -1])  # a commit in the dataset pass, the last one (self-prompts)
def test_crash_then_resume_with_sampled_regeneration_and_self_prompts(tmp_path, tok, monkeypatch, crash_at,
                                                                       greedy_sample):
    from eyas.data.prepared import PreparedWriter

    data = write_data(tmp_path / "d.jsonl", 14, bad_every=5)
    target = tiny_chat_target(tok)

    def cfg(out):
        regen = RegenConfig(samples_per_prompt=2, regen_temperature=1.0, self_prompts=5, gen_batch=4, max_new_tokens=6,
                            greedy_sample=greedy_sample)
        return PrepareConfig(data=str(data), out=str(tmp_path / out), regenerate=True, max_turns=2, batch_size=3,
                             max_len=200, heldout_fraction=0.2, regen=regen)

    real, calls = PreparedWriter.commit, []

    def counting(self, consumed, state):
        calls.append(state["self_prompts_done"])
        real(self, consumed, state)

    monkeypatch.setattr(PreparedWriter, "commit", counting)
    ref = run_prepare(cfg("ref"), target, progress=False)
    crash_at = crash_at % len(calls) + 1 if crash_at < 0 else crash_at
    assert calls[crash_at - 1] == (5 if crash_at == len(calls) else 0)
    calls.clear()

    def crashing(self, consumed, state):
        calls.append(consumed)
        if len(calls) == crash_at:  # the chunk is written but not committed: a kill right before the commit
            self._f.flush()
            self._log.flush()
            raise RuntimeError("killed")
        real(self, consumed, state)

    monkeypatch.setattr(PreparedWriter, "commit", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        run_prepare(cfg("p"), target, progress=False)
    monkeypatch.setattr(PreparedWriter, "commit", real)
    assert (tmp_path / "p" / PROGRESS).exists()
    m = run_prepare(cfg("p"), target, progress=False)
    for name in (SAMPLES, SKIPS):
        assert (tmp_path / "p" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    speed = "generation_tokens_per_s"
    assert {k: v for k, v in m["counts"].items() if k != speed} == {k: v for k, v in ref["counts"].items() if k != speed}
    ids = [s.id for s in PreparedData(tmp_path / "p")]
    assert any("#s2" in i for i in ids) and any(i.startswith("magpie-") for i in ids)
    assert len(ids) == len(set(ids)) == ref["counts"]["kept"]


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from support.models import make_tiny_llama
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
