"""Conversation sources: the truncated ShareGPT copy, JSONL, bad input counted by reason, the split."""

import gzip
import io
import json

import pytest

from eyas.data.prompts import load_prompts
from eyas.data.sources import Conversation, SkipLog, Skipped, iter_conversations, iter_records
from eyas.data.split import is_heldout, split_key
from eyas.errors import EyasError


def turns(*pairs):
    return [{"from": f, "value": v} for f, v in pairs]


def test_sharegpt_stream_stops_at_truncation(tmp_path):
    items = [{"id": f"abcdefg_{i}", "conversations": turns(("human", f"q{i}"), ("gpt", f"a{i}"))} for i in range(5)]
    text = json.dumps(items, indent=2)
    cut = text[: text.index('"a4"') + 2]  # truncated inside the last record, like the PyPI copy
    p = tmp_path / "sg.json"
    p.write_text(cut)
    recs = list(iter_records(str(p)))
    assert [r.id for r in recs if isinstance(r, Conversation)] == [f"abcdefg_{i}" for i in range(4)]
    assert isinstance(recs[-1], Skipped) and recs[-1].reason == "truncated file" and "item 4" in recs[-1].where
    # the complete file gives all five, in order, with normalised roles
    p.write_text(text)
    convs = list(iter_conversations(str(p)))
    assert len(convs) == 5 and convs[2].messages == ({"role": "user", "content": "q2"},
                                                     {"role": "assistant", "content": "a2"})


def test_sharegpt_small_read_chunks_give_same_result(tmp_path):
    from eyas.data import sources

    items = [{"id": f"x{i}", "conversations": turns(("human", "é" * (i * 37)), ("gpt", "ü ok"))} for i in range(1, 30)]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(items))
    whole = [(i, o) for i, o in sources.iter_json_array(p)]
    tiny = [(i, o) for i, o in sources.iter_json_array(p, chunk=7)]  # splits multi-byte chars too
    assert whole == tiny and [o for _, o in whole] == items


def test_bad_records_are_counted_by_reason(tmp_path):
    lines = [
        json.dumps({"id": "ok1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        "{not json",
        json.dumps({"id": "r", "messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"id": "e", "messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]}),
        json.dumps({"id": "n", "messages": [{"role": "user", "content": "only a question"}]}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a"}]}),
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"id": "u", "messages": "\xff\xfe"}\n'
    p = tmp_path / "d.jsonl"
    p.write_bytes(raw)
    log = SkipLog(echo=3, stream=io.StringIO())
    convs = list(iter_conversations(str(p), log))
    assert [c.id for c in convs][0] == "ok1" and len(convs) == 2
    assert len(convs[1].id) == 16  # no id: a content hash
    assert dict(log.counts) == {"malformed JSON": 1, "unknown role": 1, "empty turn": 1,
                                "no assistant turn": 1, "invalid UTF-8": 1}
    out = log.stream.getvalue()
    assert f"{p} line 2: malformed JSON" in out and f"{p} line 3 (id r): turn 0: unknown role 'bot'" in out
    assert f"{p} line 8: invalid UTF-8" in out


def test_leading_assistant_turns_of_a_continued_part_are_dropped(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([{"id": "abcdefg_3", "conversations": turns(("gpt", "cont"), ("human", "q"), ("gpt", "a"))}]))
    (c,) = iter_conversations(str(p))
    assert [m["role"] for m in c.messages] == ["user", "assistant"] and c.split_key == "abcdefg"


def test_missing_and_malformed_files_stop(tmp_path):
    with pytest.raises(EyasError, match="no such file"):
        list(iter_records(str(tmp_path / "nope.jsonl")))
    p = tmp_path / "bad.json"
    p.write_text('[{"id": "a", "conversations": []} {"id": "b"}, ' + " " * 100 + "]")
    with pytest.raises(EyasError, match=r"bad.json item 1: malformed JSON"):
        list(iter_records(str(p)))
    p.write_text('{"not": "an array"}')
    with pytest.raises(EyasError, match="expected a JSON array"):
        list(iter_records(str(p)))


def test_split_is_a_pure_function_of_the_id():
    ids = [f"id{i}" for i in range(20000)]
    held = {i for i in ids if is_heldout(i, 0.05)}
    assert 0.04 < len(held) / len(ids) < 0.06
    assert held == {i for i in reversed(ids) if is_heldout(i, 0.05)}  # order-free
    assert held <= {i for i in ids if is_heldout(i, 0.10)}  # nested fractions
    assert split_key("QWJhYvA_12", sharegpt=True) == split_key("QWJhYvA_0", sharegpt=True) == "QWJhYvA"
    assert split_key("sample_12") == "sample_12"
    # sampled reply sets <id>#sK (prepare --samples-per-prompt) share their conversation's key
    assert split_key("QWJhYvA_3#s2", sharegpt=True) == "QWJhYvA" and split_key("c7#s11") == "c7"
    assert split_key("a#b") == "a#b" and split_key("#s1") == "#s1"


def test_prompt_files(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\n{"question_id": 81, "turns": ["t1", "t2"]}\n{"x": 1}\n')
    log = SkipLog(stream=io.StringIO())
    assert load_prompts(str(p), skips=log) == [{"id": "1", "turns": ["a"]}, {"id": "81", "turns": ["t1", "t2"]}]
    assert log.counts == {"malformed record": 1}


def test_prompt_loading_prints_one_summary_line(tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\n{"x": 1}\n{"y": 2}\nnot json\n')
    assert load_prompts(str(p)) == [{"id": "1", "turns": ["a"]}]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"eyas: skipped 3 malformed records of {p} (2 malformed record, 1 malformed JSON)"]
    assert load_prompts(str(p)) == [{"id": "1", "turns": ["a"]}]  # the same set again (eyas run: once per bench)
    assert capsys.readouterr().err == ""
    p.write_text('{"id": 1, "prompt": "a"}\nnot json\n')  # other skips: their own line
    load_prompts(str(p))
    assert capsys.readouterr().err.strip() == f"eyas: skipped 1 malformed records of {p} (1 malformed JSON)"


def test_humaneval_prompts():
    ps = load_prompts("humaneval")
    assert len(ps) == 164 and ps[0]["id"] == "HumanEval/0" and ps[0]["turns"][0].startswith("from typing import List")


@pytest.mark.slow
def test_embedded_sharegpt_counts():
    log = SkipLog(stream=io.StringIO())
    recs = list(iter_records("sharegpt"))
    complete = [r for r in recs if not (isinstance(r, Skipped) and r.reason == "truncated file")]
    assert len(complete) == 17671 and recs[-1].reason == "truncated file"
    held = load_prompts("sharegpt-heldout", skips=log)
    convs = [r for r in recs if isinstance(r, Conversation)]
    assert {p["id"] for p in held} == {c.id for c in convs if is_heldout(c.split_key)}
    assert all(p["turns"] and all(t.strip() for t in p["turns"]) for p in held)


def test_a_filtered_prompt_load_stops_at_the_limit_and_equals_filter_then_cut(tmp_path):
    """load_prompts(keep=...) counts only kept records towards the limit and stops reading there (bench's
    --max-prompt-tokens used to read every held-out ShareGPT conversation first: ~6 s per bench)."""
    import json as _json

    from eyas.bench.bench import BenchConfig, load_bench_prompts
    from eyas.data.prompts import load_prompts

    p = tmp_path / "p.jsonl"
    p.write_text("".join(_json.dumps({"prompt": "x " * n}) + "\n" for n in [3, 40, 5, 50, 7, 60, 9, 11, 70, 13]))
    seen = []

    def short(r):
        seen.append(r["id"])
        return len(r["turns"][0]) < 30

    got = load_prompts(str(p), limit=3, keep=short)
    reference = [r for r in load_prompts(str(p)) if len(r["turns"][0]) < 30][:3]
    assert got == reference and len(got) == 3
    assert len(seen) == 5                              # 3 kept + 2 too long, nothing read after the third keep

    from eyas.data.chat import encode_prompt
    from support.models import byte_tokenizer

    tok = byte_tokenizer()                             # a real fast tokenizer with a chat template, built here
    lengths = [len(encode_prompt(tok, [{"role": "user", "content": r["turns"][0]}])) for r in load_prompts(str(p))]
    cap = sorted(lengths)[5]                           # keeps 6 of the 10
    naive = [r for r, n in zip(load_prompts(str(p)), lengths) if n <= cap][:3]
    recs, skipped = load_bench_prompts(BenchConfig(prompts=str(p), limit=3, max_prompt_tokens=cap), tok)
    read = lengths[: [i for i, n in enumerate(lengths) if n <= cap][2] + 1]   # up to the third kept record
    assert recs == naive and skipped == sum(n > cap for n in read) > 0
