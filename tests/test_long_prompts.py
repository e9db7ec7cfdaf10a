"""The `long` prompt set: held-out chats only (the complement of what prepare writes), ShareGPT parts joined in
order with the earlier turns as written, both kinds, the token range, and bench encoding a record's context."""

import json
import threading
from pathlib import Path

import pytest

from eyas.bench.bench import BenchConfig, prompt_room, run_bench
from eyas.bench.prompts import first_messages, load_bench_prompts
from eyas.data.chat import encode_prompt
from eyas.data.longprompts import LONG_TOKENS
from eyas.data.prompts import load_prompts
from eyas.data.split import is_heldout, split_key
from eyas.errors import EyasError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

FRACTION = 0.05   # load_prompts' default, which bench uses


def ids_split(n: int, heldout: bool) -> list[str]:
    """n ShareGPT-style 7-character chat ids on one side of the FRACTION split."""
    out = [f"c{i:06d}" for i in range(2000) if is_heldout(f"c{i:06d}", FRACTION) == heldout]
    assert len(out) >= n
    return out[:n]


def text(tag: str, n: int) -> str:
    """A distinct text of about n bytes."""
    words = f"{tag} lorem ipsum dolor sit amet consectetur".split()
    return " ".join(words[i % len(words)] + str(i) for i in range(n // 8))[:n]


def h(v):
    return {"from": "human", "value": v}


def g(v):
    return {"from": "gpt", "value": v}


def write_sharegpt(path: Path, items: list[dict]) -> str:
    path.write_text(json.dumps(items))
    return str(path)


def chat_key(record_id: str) -> str:
    """The split key of a long record's chat (ids: PART, FIRST..LAST, or either with @TURN)."""
    return split_key(record_id.split("@")[0].split("..")[0], sharegpt=True)


# ---- the source --------------------------------------------------------------------------------------------

def test_long_set_is_exactly_the_heldout_side_of_prepare(tmp_path):
    """Every chat prepare writes is absent from the long set, and every other (long enough) chat is in it: the
    check runs prepare itself on a made-up ShareGPT file, with the same held-out fraction."""
    from support.models import byte_tokenizer

    from support.models import make_tiny_llama
    from eyas.data.prepare import PrepareConfig, run_prepare
    from eyas.data.prepared import PreparedData
    from eyas.target import target_from_model

    items = []
    for cid in ids_split(6, True) + ids_split(6, False):
        # two parts in order, the second repeating the first's last turn: one chat, one split key
        a, b = text(cid + "a", 600), text(cid + "b", 600)
        items += [{"id": f"{cid}_0", "conversations": [h(text(cid + "q", 1500)), g(a), h("and then?"), g(b)]},
                  {"id": f"{cid}_3", "conversations": [g(b), h("summarise it"), g("done")]}]
    data = write_sharegpt(tmp_path / "chats.json", items)
    tok = byte_tokenizer()
    target = target_from_model(make_tiny_llama(vocab=len(tok)), tok, name="tiny")
    run_prepare(PrepareConfig(target="tiny", data=data, out=str(tmp_path / "p"), max_len=256,
                              heldout_fraction=FRACTION), target, progress=False)
    written = {split_key(s.id, sharegpt=True) for s in PreparedData(tmp_path / "p")}
    long = load_prompts(f"long:{data}", heldout_fraction=FRACTION)
    every = {split_key(it["id"], sharegpt=True) for it in items}
    assert len(written) == 6 and {chat_key(r["id"]) for r in long} == every - written
    assert [r["id"] for r in long if r["kind"] == "conversation"] == [f"{c}_0..{c}_3" for c in ids_split(6, True)]


def test_parts_join_in_order_with_the_turns_as_written(tmp_path):
    """Consecutive parts (starting where the chat ended, or one turn earlier with that same turn) make one chat
    whose context is every earlier turn as written, in order; a gap or a different repeat starts a new chat."""
    a, b, c = ids_split(3, True)
    t = {k: text(k, 1100) for k in ("u1", "a1", "a2", "u3", "a3", "u4", "u5", "a5", "u6")}
    t["u2"] = text("u2", 2100)                                                    # long alone: also a document
    items = [
        {"id": f"{a}_0", "conversations": [h(t["u1"]), g(t["a1"]), h(t["u2"]), g(t["a2"])]},
        {"id": f"{a}_3", "conversations": [g(t["a2"]), h(t["u3"]), g(t["a3"])]},      # repeats a2
        {"id": f"{a}_6", "conversations": [h(t["u4"]), g("reply to u4")]},           # starts where _3 ended
        {"id": f"{a}_10", "conversations": [h(t["u5"]), g(t["a5"]), h("ok?"), g("ok")]},  # a gap: a new chat
        {"id": f"{b}_0", "conversations": [h(t["u1"]), g(t["a1"]), h(t["u3"]), g("x")]},
        {"id": f"{b}_3", "conversations": [g("not x"), h(t["u6"]), g(t["a5"]), h("more"), g("y")]},  # differs
        {"id": f"{c}_0", "conversations": [h("short"), g("short")]},                 # too short for the set
    ]
    data = write_sharegpt(tmp_path / "chats.json", items)
    recs = {r["id"]: r for r in load_prompts(f"long:{data}", heldout_fraction=FRACTION)}
    joined = recs[f"{a}_0..{a}_6"]
    roles = ["user", "assistant"] * 3
    assert joined["kind"] == "conversation" and joined["turns"] == [t["u4"]]
    assert joined["context"] == [{"role": r, "content": t[k]} for r, k in zip(roles, ("u1", "a1", "u2", "a2", "u3",
                                                                                        "a3"))]
    gap = recs[f"{a}_10"]
    assert gap["context"] == [{"role": "user", "content": t["u5"]}, {"role": "assistant", "content": t["a5"]}]
    assert recs[f"{b}_0"]["turns"] == [t["u3"]] and recs[f"{b}_3"]["context"][0]["content"] == t["u6"]
    assert set(recs) == {f"{a}_0..{a}_6", f"{a}_0..{a}_6@2", f"{a}_10", f"{b}_0", f"{b}_3"}   # c: too short
    # a long user turn is also a document on its own (the chat's system message only as context)
    doc = recs[f"{a}_0..{a}_6@2"]
    assert doc == {"id": f"{a}_0..{a}_6@2", "kind": "document", "context": [], "turns": [t["u2"]]}


def test_order_alternates_kinds_and_cycles_conversation_lengths_deterministically(tmp_path):
    """Any first N of the set spreads over both kinds and the conversations' length classes: documents and
    conversations alternate while both last, conversations cycle short / middle / long, each in file order."""
    sizes = [2500, 4000, 13000, 2600, 20000, 4100, 2700, 2800, 4200, 2900, 3000, 3100]   # every 3rd: a document
    items = []
    for i, (cid, n) in enumerate(zip(ids_split(12, True), sizes)):
        items += [{"id": f"{cid}_0", "conversations": [h(text(cid, n)), g("summary")]} if i % 3 == 0 else
                  {"id": f"{cid}_0", "conversations": [h(text(cid + "x", 1000)), g(text(cid + "y", n - 1000)),
                                                       h("what next?"), g("this")]}]
    data = write_sharegpt(tmp_path / "chats.json", items)
    recs = load_prompts(f"long:{data}", heldout_fraction=FRACTION)
    assert recs == load_prompts(f"long:{data}", heldout_fraction=FRACTION)
    ids = ids_split(12, True)
    # conversations by class: short 1, 5, 7, 8, 10, 11; middle (13,000 bytes) 2; long (20,000 bytes) 4
    order = [(r["kind"][0], ids.index(r["id"].split("_")[0])) for r in recs]
    assert order == [("d", 0), ("c", 1), ("d", 3), ("c", 2), ("d", 6), ("c", 4), ("d", 9), ("c", 5), ("c", 7),
                     ("c", 8), ("c", 10), ("c", 11)]
    assert all(sum(len(m["content"].encode()) for m in first_messages(r)) >= LONG_TOKENS[0] for r in recs)
    assert load_prompts(f"long:{data}", heldout_fraction=FRACTION, limit=3) == recs[:3]


def test_bench_keeps_the_token_range_and_counts_the_rest(tmp_path):
    """load_bench_prompts keeps the records whose first prompt (context + turn, template applied) is in
    [min, max] tokens; the others are counted, by side; `long` defaults to LONG_TOKENS and a cache that holds it."""
    from support.models import byte_tokenizer

    tok = byte_tokenizer()
    items = [{"id": f"{cid}_0", "conversations": [h(text(cid, 2100 + 400 * i)), g("ok"), h("more?"), g("yes")]}
             for i, cid in enumerate(ids_split(10, True))]
    data = write_sharegpt(tmp_path / "chats.json", items)
    everything = load_prompts(f"long:{data}", heldout_fraction=FRACTION)
    sizes = {r["id"]: len(encode_prompt(tok, first_messages(r))) for r in everything}
    lo, hi = sorted(sizes.values())[3], sorted(sizes.values())[-4]
    counts = {}
    cfg = BenchConfig(prompts=f"long:{data}", min_prompt_tokens=lo, max_prompt_tokens=hi, limit=None)
    recs, too_long = load_bench_prompts(cfg, tok, counts)
    assert sorted(r["id"] for r in recs) == sorted(i for i, n in sizes.items() if lo <= n <= hi)
    assert len(recs) == 14 and counts == {"too_long": 3, "too_short": 3} and too_long == 3
    with pytest.raises(EyasError, match=f"no prompts of {hi + 1} to {hi + 2} tokens"):
        load_bench_prompts(BenchConfig(prompts=f"long:{data}", min_prompt_tokens=hi + 1, max_prompt_tokens=hi + 2), tok)
    d = BenchConfig(prompts="long", max_new_tokens=256)
    assert (d.min_prompt_tokens, d.max_prompt_tokens) == LONG_TOKENS and prompt_room(d) >= LONG_TOKENS[1]
    assert BenchConfig(prompts="long", max_seq=8192).max_seq == 8192 and BenchConfig().max_seq == 2048


# ---- bench --------------------------------------------------------------------------------------------------

def context_prompts(tmp_path) -> tuple[str, list[dict]]:
    ctx = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first question"},
           {"role": "assistant", "content": "an earlier answer, as written"}]
    lines = [{"id": "with-context", "context": ctx, "turns": ["and now?", "then?"]},
             {"id": "old", "turns": ["hello there", "again"]}]
    p = tmp_path / "ctx.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(p), ctx


def test_bench_encodes_the_context_before_the_turns_and_stays_lossless(tiny, tmp_path, monkeypatch):
    """A record's context reaches the target in order before its first turn (later turns follow each method's
    own answers), an old-style record is encoded as before, and the speculative outputs equal plain greedy."""
    from eyas.bench import bench as bench_mod

    target, drafter = tiny
    path, ctx = context_prompts(tmp_path)
    seen = []
    real = bench_mod.prompt_ids

    def spy(tok, msgs, room):
        seen.append([dict(m) for m in msgs])
        return real(tok, msgs, room)

    monkeypatch.setattr(bench_mod, "prompt_ids", spy)
    rep = run_bench(BenchConfig(prompts=path, k=3, max_new_tokens=10, max_seq=200), target=target, drafter=drafter)
    first = seen[1:]   # seen[0]: the warm-up prompt, the first record's first prompt
    assert seen[0] == ctx + [{"role": "user", "content": "and now?"}]
    assert len(first) == 12    # record by record, each method turn by turn: 2 records x 3 methods x 2 turns
    for m in range(3):
        a, b = first[2 * m: 2 * m + 2]
        assert a == ctx + [{"role": "user", "content": "and now?"}]
        assert b[:4] == a and b[4]["role"] == "assistant" and b[5] == {"role": "user", "content": "then?"}
        c, d = first[6 + 2 * m: 8 + 2 * m]
        assert c == [{"role": "user", "content": "hello there"}] and d[0] == c[0] and d[-1]["content"] == "again"
    tok = target.tokenizer
    assert encode_prompt(tok, seen[0]) == encode_prompt(tok, ctx[:1] + ctx[1:] + [{"role": "user", "content": "and now?"}])
    assert rep["records"] == 2 and rep["turns"] == 4
    for name in ("lookup", "eagle-chain"):
        assert rep["lossless"][name]["held"] and rep["lossless"][name]["identical_turns"] == 4
    assert rep["prompts"]["tokens"]["max"] == len(encode_prompt(tok, seen[0]))


def test_bench_reports_prompt_lengths_and_tau_by_kind(tiny, tmp_path):
    target, drafter = tiny
    lines = [{"id": "d", "kind": "document", "turns": ["x" * 40]},
             {"id": "c", "kind": "conversation", "context": [{"role": "user", "content": "q"},
                                                             {"role": "assistant", "content": "a"}], "turns": ["b"]}]
    p = tmp_path / "k.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = run_bench(BenchConfig(prompts=str(p), k=3, max_new_tokens=8, max_seq=200), target=target, drafter=drafter)
    assert "kind" not in load_prompts(str(p))[0]   # a prompt file's records do not carry kinds...
    assert rep["prompts"]["kinds"] == {}           # ...so no per-kind tau
    recs = [{**r, "kind": k} for r, k in zip(load_prompts(str(p)), ("document", "conversation"))]
    rep = run_bench(BenchConfig(k=3, max_new_tokens=8, max_seq=200), target=target, drafter=drafter, records=recs)
    assert rep["prompts"]["kinds"] == {"document": 1, "conversation": 1}
    for m in rep["methods"].values():
        (t1, f1), (t2, f2) = m["per_record"]
        assert m["tau_by_kind"] == {"document": round(t1 / f1, 4), "conversation": round(t2 / f2, 4)}


def test_engine_bench_sends_the_context(tmp_path):
    """bench --engine encodes a record's context before its turn too (the ids the server gets)."""
    from support.models import byte_tokenizer

    from eyas.bench.engine import _answer

    class Server:
        engine, flag, url = "vllm", "--url", "http://x"

        def __init__(self):
            self.ids = []

        def generate(self, ids, n, eos):
            self.ids.append(list(ids))
            return [65, 66], None, None

    tok, srv = byte_tokenizer(), Server()
    _, ctx = context_prompts(tmp_path)
    _answer(srv, {"context": ctx, "turns": ["and now?", "then?"]}, tok, 1000, 2, [257], False, threading.Event())
    assert srv.ids[0] == encode_prompt(tok, ctx + [{"role": "user", "content": "and now?"}])
    assert srv.ids[1] == encode_prompt(tok, ctx + [{"role": "user", "content": "and now?"},
                                                   {"role": "assistant", "content": tok.decode([65, 66])},
                                                   {"role": "user", "content": "then?"}])


def test_a_bad_context_is_skipped_with_its_reason(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"context": [{"role": "robot", "content": "x"}], "turns": ["a"]}) + "\n"
                 + json.dumps({"context": "text", "turns": ["a"]}) + "\n" + json.dumps({"turns": ["fine"]}) + "\n")
    from eyas.data.sources import SkipLog

    log = SkipLog()
    assert [r["turns"] for r in load_prompts(str(p), skips=log)] == [["fine"]]
    assert log.counts == {"malformed record": 2} and "context message 0" in log.first["malformed record"]


# ---- the command line and the gpu preset -----------------------------------------------------------------

def test_cli_bench_prompts_long():
    from eyas.bench.command import bench_config
    from eyas.cli import build_parser

    p = build_parser()
    cfg = bench_config(p.parse_args(["bench", "--prompts", "long", "--max-new-tokens", "256"]), "cpu")
    assert cfg.prompts == "long" and (cfg.min_prompt_tokens, cfg.max_prompt_tokens) == LONG_TOKENS
    assert prompt_room(cfg) >= LONG_TOKENS[1] and cfg.max_seq % 64 == 0
    cfg = bench_config(p.parse_args(["bench", "--prompts", "long", "--min-prompt-tokens", "3000", "--max-seq", "8192"]),
                       "cpu")
    assert (cfg.min_prompt_tokens, cfg.max_prompt_tokens, cfg.max_seq) == (3000, LONG_TOKENS[1], 8192)


def test_gpu_preset_benches_the_long_set_with_its_own_prompt_range(tmp_path):
    """The gpu preset has a chain-5 bench on `long` whose prompt range and cache are its own (the other benches
    keep max_prompt_tokens = prepare.max_len - max_new_tokens); a [[bench]] table may set max_prompt_tokens."""
    from eyas.run import RunConfig, resolve_stages

    stages = resolve_stages(RunConfig(preset="gpu"), Path("RUN"), vocab_size=49152)
    long = stages.bench["long-chain5"]
    assert long.prompts == "long" and long.spec.method == "chain" and long.spec.k == 5 and long.spec.graph_round
    assert (long.min_prompt_tokens, long.max_prompt_tokens) == LONG_TOKENS and prompt_room(long) >= LONG_TOKENS[1]
    assert long.json_out == "RUN/bench/long-chain5.json"
    short = stages.bench["sharegpt-heldout-chain5"]
    assert short.max_prompt_tokens == stages.prepare.max_len - stages.prepare.regen.max_new_tokens
    assert short.min_prompt_tokens is None and short.max_seq == 2048
    recipe = tmp_path / "r.toml"
    recipe.write_text("[[bench]]\nprompts = \"humaneval\"\nmax_prompt_tokens = 1000\n[[bench]]\n")
    b = resolve_stages(RunConfig(recipe_file=str(recipe)), Path("RUN"), vocab_size=100).bench
    assert b["humaneval-chain5"].max_prompt_tokens == 1000 and b["sharegpt-heldout-chain5"].max_prompt_tokens == 1536


def test_run_report_names_the_long_set(tmp_path):
    from types import SimpleNamespace

    from eyas.report import write_report

    run = tmp_path / "run"
    (run / "bench").mkdir(parents=True)
    eagle = {"tokens": 90, "tokens_per_s": 100.0, "tau": 2.5, "speedup": 1.4, "acceptance_by_position": [0.8],
             "per_record": [[50, 20], [40, 16]], "tau_by_kind": {"document": 2.5, "conversation": 2.5}}
    lookup = {**eagle, "tau": 1.5, "tau_by_kind": {}}
    r = {"records": 2, "device": "cuda", "methods": {"lookup": lookup, "eagle-chain": eagle},
         "prompts": {"tokens": {"min": 2100, "median": 3000, "max": 5000}, "kinds": {"document": 1, "conversation": 1}}}
    (run / "bench" / "long-chain5.json").write_text(json.dumps(r))
    summary = write_report(run, {"stages": {}}, SimpleNamespace(preset="gpu", target="t", data="d"))
    line = next(x for x in summary.splitlines() if "long-chain5" in x)
    assert "2 prompts of 2100-5000 tokens (1 document tau 2.50, 1 conversation tau 2.50)" in line


# ---- the real set ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_shipped_long_set_with_smollm2():
    """On the embedded ShareGPT copy and SmolLM2's tokenizer: over 100 prompts, both kinds in the first 30 and
    lengths past 4k tokens, all in the range, none from a chat prepare trains on."""
    from eyas.target.meta import open_target_meta

    tok = open_target_meta("smollm2-135m", tensors=()).tokenizer
    counts = {}
    recs, _ = load_bench_prompts(BenchConfig(prompts="long", limit=None), tok, counts)
    kinds = [r["kind"] for r in recs]
    assert len(recs) >= 100 and kinds.count("document") >= 15 and kinds[:30].count("document") == 15
    sizes = [len(encode_prompt(tok, first_messages(r))) for r in recs]
    assert sum(n >= 4096 for n in sizes[:30]) >= 4                 # the first 30 reach past 4k tokens
    assert LONG_TOKENS[0] <= min(sizes) and max(sizes) <= LONG_TOKENS[1]
    assert all(is_heldout(chat_key(r["id"])) for r in recs)
