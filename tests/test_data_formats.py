"""--data as users hold it: OpenAI `messages` JSONL, Parquet and `datasets.save_to_disk` directories read the same
records as JSONL, bad rows are skipped by the same reasons, and a source in no accepted format is one line, exit 2,
nothing written."""

import io
import json
import sys

import pytest

from test_prepare import tiny_chat_target, tok, write_data  # noqa: F401  (tok: the module's tokenizer fixture)

from eyas.cli import main
from eyas.data.prepare import PrepareConfig, run_prepare
from eyas.data.prepared import SAMPLES
from eyas.data.prompts import load_prompts
from eyas.data.sources import Conversation, SkipLog, iter_conversations, iter_records

USER, BOT, SYS = "user", "assistant", "system"


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


# each record with what JSONL makes of it: kept (the messages read), or skipped by a reason
RECORDS = [
    ({"id": "a", "messages": msgs((USER, "hi"), (BOT, "hello"))}, "kept"),
    ({"id": "b", "messages": msgs((SYS, "be brief"), (USER, "q1"), (BOT, "r1"), (USER, "q2"), (BOT, "r2"))}, "kept"),
    ({"id": "c", "messages": msgs((BOT, "a stray reply"), (USER, "q"), (BOT, "r"))}, "kept"),   # leading reply dropped
    ({"messages": msgs((USER, "no id"), (BOT, "a content hash"))}, "kept"),
    ({"id": "d", "messages": msgs((USER, "q"), ("bot", "r"))}, "unknown role"),
    ({"id": "e", "messages": msgs((USER, "  "), (BOT, "r"))}, "empty turn"),
    ({"id": "f", "messages": msgs((USER, "only a question"))}, "no assistant turn"),
    ({"id": "g", "messages": msgs((USER, "q"), (SYS, "late"), (BOT, "r"))}, "misplaced system turn"),
    ({"id": "h", "messages": []}, "empty conversation"),
    ({"id": "i", "messages": [{"role": USER, "content": None}, {"role": BOT, "content": "r"}]}, "malformed record"),
    ({"id": "j"}, "malformed record"),   # no turns at all (a null cell in a table)
]


def sharegpt(rec):
    """The same record as ShareGPT `conversations` (from/value; the roles human/gpt/system)."""
    names = {USER: "human", BOT: "gpt", SYS: "system"}
    out = {k: v for k, v in rec.items() if k != "messages"}
    if "messages" in rec:
        out["conversations"] = [{"from": names.get(m["role"], m["role"]), "value": m["content"]}
                                for m in rec["messages"]]
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def table(records):
    """An Arrow table of the records, a column for every key of any record (null where a record lacks it)."""
    pa = pytest.importorskip("pyarrow")
    keys = list(dict.fromkeys(k for r in records for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in records])   # infers the columns from row 0


def write_parquet(path, records):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(table(records), path)
    return path


def save_dataset(path, splits):
    """`Dataset.save_to_disk` of each split's records (a DatasetDict when there are several or the name is not None)."""
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    def dataset(records, name):
        # an explicit fingerprint: Dataset.from_list hashes the table with dill, which fails on the pyarrow 26 /
        # datasets 5.2 pair (PicklingError on pyarrow's MonthDayNano); loading what save_to_disk wrote never hashes
        return datasets.Dataset(InMemoryTable(table(records)), fingerprint=f"test-{name}")

    if list(splits) == [None]:
        dataset(splits[None], "one").save_to_disk(str(path))
    else:
        datasets.DatasetDict({k: dataset(v, k) for k, v in splits.items()}).save_to_disk(str(path))
    return path


def read(path):
    """(kept conversations as (id, messages, split key), skip reasons), in order, from any source."""
    recs = list(iter_records(str(path)))
    kept = [(r.id, r.messages, r.split_key) for r in recs if isinstance(r, Conversation)]
    return kept, [r.reason for r in recs if not isinstance(r, Conversation)]


def expected():
    kept = [r for r, what in RECORDS if what == "kept"]
    return len(kept), [what for _, what in RECORDS if what != "kept"]


def test_openai_messages_jsonl_is_read_with_roles_kept_and_bad_records_counted(tmp_path):
    kept, reasons = read(write_jsonl(tmp_path / "d.jsonl", [r for r, _ in RECORDS]))
    assert reasons == expected()[1]
    assert [k[0] for k in kept[:3]] == ["a", "b", "c"] and len(kept[3][0]) == 16   # no id: a content hash
    assert kept[1][1] == tuple(msgs((SYS, "be brief"), (USER, "q1"), (BOT, "r1"), (USER, "q2"), (BOT, "r2")))
    assert kept[2][1] == tuple(msgs((USER, "q"), (BOT, "r")))
    # the same conversations as a ShareGPT array read the same (ids without a _N part: the same split keys)
    p = tmp_path / "d.json"
    p.write_text(json.dumps([sharegpt(r) for r, _ in RECORDS]))
    assert read(p) == (kept, reasons)


@pytest.mark.parametrize("column", ["messages", "conversations", "both"])
def test_parquet_reads_the_records_jsonl_reads(tmp_path, column):
    # "both": every other record in ShareGPT form, so each row has one of the two columns null
    records = [r if column == "messages" or (column == "both" and i % 2) else sharegpt(r)
               for i, (r, _) in enumerate(RECORDS)]
    reference = read(write_jsonl(tmp_path / "d.jsonl", records))
    assert read(write_parquet(tmp_path / "d.parquet", records)) == reference
    assert len(reference[0]) == expected()[0] and reference[1] == expected()[1]
    # a skipped row is named by its 0-based row number, as ds[i] and pandas count
    skips = SkipLog(stream=io.StringIO())
    list(iter_conversations(str(tmp_path / "d.parquet"), skips))
    assert skips.first["unknown role"].startswith(f"{tmp_path / 'd.parquet'} row 4 (id d): turn 1: unknown role 'bot'")


def test_save_to_disk_dataset_and_the_train_split_of_a_dataset_dict(tmp_path, capsys):
    records = [r for r, _ in RECORDS]
    reference = read(write_jsonl(tmp_path / "d.jsonl", records))
    assert read(save_dataset(tmp_path / "one", {None: records})) == reference
    other = [{"id": "t", "messages": msgs((USER, "test split"), (BOT, "never read"))}]
    capsys.readouterr()
    assert read(save_dataset(tmp_path / "two", {"test": other, "train": records})) == reference
    said = capsys.readouterr().err
    assert f"{tmp_path / 'two'} is a DatasetDict (splits test, train): reading its 'train' split" in said
    recs = list(iter_records(str(tmp_path / "two")))
    assert recs[4].where == f"{tmp_path / 'two'} split train row 4 (id d)"


def test_prepare_from_parquet_and_save_to_disk_writes_the_jsonl_samples(tmp_path, tok):  # noqa: F811
    pytest.importorskip("pyarrow")
    jsonl = write_data(tmp_path / "d.jsonl", 40)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    target = tiny_chat_target(tok)
    outs = {}
    for name, data in [("jsonl", jsonl), ("parquet", write_parquet(tmp_path / "d.parquet", records))]:
        m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / name), max_len=120, heldout_fraction=0.2,
                                      batch_size=7), target, progress=False)
        outs[name] = ((tmp_path / name / SAMPLES).read_bytes(), m["counts"])
    assert outs["parquet"] == outs["jsonl"] and outs["jsonl"][1]["kept"] > 20
    pytest.importorskip("datasets")
    data = save_dataset(tmp_path / "ds", {None: records})
    m = run_prepare(PrepareConfig(data=str(data), out=str(tmp_path / "ds-p"), max_len=120, heldout_fraction=0.2,
                                  batch_size=7), target, progress=False)
    assert ((tmp_path / "ds-p" / SAMPLES).read_bytes(), m["counts"]) == outs["jsonl"]


def test_bench_prompts_and_held_out_prompts_from_parquet(tmp_path):
    records = [sharegpt(r) for r, _ in RECORDS]
    p = tmp_path / "d.json"
    p.write_text(json.dumps(records))
    reference = load_prompts(str(p))
    assert reference and load_prompts(str(write_parquet(tmp_path / "d.parquet", records))) == reference
    assert load_prompts(f"heldout:{tmp_path / 'd.parquet'}", heldout_fraction=0.5) == \
        load_prompts(f"heldout:{p}", heldout_fraction=0.5)


def fail(argv, capsys):
    """Run the CLI; return its stderr's error line after checking it is the only error and the exit is 2."""
    capsys.readouterr()
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    return err[0]


def prepare_fails(tmp_path, capsys, data, message):
    out = tmp_path / "out"
    line = fail(["prepare", "--data", str(data), "--out", str(out)], capsys)
    assert line.startswith("eyas prepare: error: ") and message in line, line
    assert not out.exists()


FORMATS = ("expected 'sharegpt', a ShareGPT .json array, a .jsonl of {\"messages\": [...]} lines, a .parquet file "
           "or a directory written by datasets.save_to_disk")


def test_a_file_in_no_accepted_format_is_one_line_naming_the_formats(tmp_path, capsys):
    csv = tmp_path / "d.csv"
    csv.write_text("role,content\nuser,hi\n")
    prepare_fails(tmp_path, capsys, csv, f"{csv}: unknown data format '.csv'; {FORMATS}")
    bare = tmp_path / "chats"
    bare.write_text("{}\n")
    prepare_fails(tmp_path, capsys, bare, f"{bare}: unknown data format (no file extension); {FORMATS}")
    prepare_fails(tmp_path, capsys, tmp_path / "none.parquet", f"no such file or directory ({FORMATS})")
    # content that is not what the name says: CSV in a .jsonl, JSON lines in a .json, an array in a .jsonl
    fake = tmp_path / "d.jsonl"
    fake.write_text("role,content\nuser,hi\n")
    prepare_fails(tmp_path, capsys, fake, f"{fake}: expected JSON lines, one {{\"messages\": [...]}} object per line, "
                                          f"found 'role,content'")
    fake.write_text(json.dumps([RECORDS[0][0]]))
    prepare_fails(tmp_path, capsys, fake, "(a JSON array? name the file .json)")
    js = write_jsonl(tmp_path / "d.json", [RECORDS[0][0]])
    prepare_fails(tmp_path, capsys, js, f"{js}: expected a JSON array of conversations, found '{{\"id\": \"a\"")
    # a directory that datasets.save_to_disk did not write
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.parquet").write_bytes(b"")
    prepare_fails(tmp_path, capsys, plain, f"{plain}: a directory, but not one written by datasets.save_to_disk "
                                           f"(no dataset_dict.json, nor state.json and dataset_info.json); it holds "
                                           f".parquet files: pass one of them")


def test_a_missing_optional_package_is_one_line_saying_what_to_install(tmp_path, capsys, monkeypatch):
    pq = tmp_path / "d.parquet"
    pq.write_bytes(b"PAR1")
    ds = tmp_path / "ds"
    ds.mkdir()
    for name in ("state.json", "dataset_info.json"):
        (ds / name).write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow", None)    # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    prepare_fails(tmp_path, capsys, pq, "reading Parquet files needs the package 'pyarrow', which is not installed "
                                        "(pip install 'eyas[datasets]')")
    prepare_fails(tmp_path, capsys, ds, "reading a datasets.save_to_disk directory needs the package 'datasets', "
                                        "which is not installed (pip install 'eyas[datasets]')")


def test_a_table_without_a_turn_column_is_one_line_naming_its_columns(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    cols = write_parquet(tmp_path / "cols.parquet", [{"id": "a", "prompt": "q", "response": "r"}])
    prepare_fails(tmp_path, capsys, cols, f"{cols}: no 'messages' or 'conversations' column (its columns: id, prompt, "
                                          f"response); expected 'messages' as lists of {{role, content}}")
    text = write_parquet(tmp_path / "text.parquet", [{"messages": json.dumps(RECORDS[0][0]["messages"])}])
    prepare_fails(tmp_path, capsys, text, f"{text}: column 'messages' has type string, expected a list of "
                                          f"{{role, content}}")
    keys = write_parquet(tmp_path / "keys.parquet", [{"messages": [{"role": USER, "text": "q"}]}])
    prepare_fails(tmp_path, capsys, keys, "column 'messages' has type list<element: struct<role: string, text: "
                                          "string>>, expected a list of {role, content}")
    junk = tmp_path / "junk.parquet"
    junk.write_text("id,messages\n")
    prepare_fails(tmp_path, capsys, junk, f"{junk}: not a readable Parquet file (")
    pytest.importorskip("datasets")
    ds = save_dataset(tmp_path / "ds", {None: [{"id": "a", "text": "q"}]})
    prepare_fails(tmp_path, capsys, ds, f"{ds}: no 'messages' or 'conversations' column (its columns: id, text)")
    dd = save_dataset(tmp_path / "dd", {"train": [{"id": "a", "text": "q"}]})
    prepare_fails(tmp_path, capsys, dd, f"{dd} split train: no 'messages' or 'conversations' column (its columns: "
                                        f"id, text)")
    nt = save_dataset(tmp_path / "nt", {"test": [r for r, _ in RECORDS[:2]], "validation": [RECORDS[0][0]]})
    prepare_fails(tmp_path, capsys, nt, f"{nt}: a DatasetDict without a 'train' split (its splits: test, validation)")


def test_the_long_prompt_set_from_parquet_and_a_saved_dataset_is_the_jsonl_one(tmp_path):
    """`long:DATA` reads every accepted format: the same held-out records, contexts and kinds from a .jsonl, a .parquet
    and a datasets.save_to_disk directory of the same conversations."""
    pytest.importorskip("pyarrow")
    words = "the quick brown fox jumps over the lazy dog while a log of errors scrolls past".split()
    records = []
    for i in range(24):
        doc = " ".join(words[(i + j) % len(words)] for j in range(500 + 40 * i))   # 2-5 kB: a long single turn
        records.append({"id": f"c{i}", "messages": msgs((USER, f"summarise this: {doc}"), (BOT, "a summary"),
                                                         (USER, "and the errors?"), (BOT, "two of them"))})
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    reference = load_prompts(f"long:{jsonl}", heldout_fraction=0.5)
    kinds = {r["kind"] for r in reference}
    assert len(reference) >= 6 and kinds == {"document", "conversation"}
    assert load_prompts(f"long:{write_parquet(tmp_path / 'd.parquet', records)}", heldout_fraction=0.5) == reference
    pytest.importorskip("datasets")
    assert load_prompts(f"long:{save_dataset(tmp_path / 'ds', {None: records})}", heldout_fraction=0.5) == reference
