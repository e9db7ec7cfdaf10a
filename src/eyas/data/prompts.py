"""Prompt sets for the bench: `load_prompts` reads a named set (held-out ShareGPT, HumanEval, long prompts) or a
file of prompts or conversations. It sits above both conversation readers it draws on, eyas.data.sources and
eyas.data.longprompts."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Iterator

from eyas.data.longprompts import long_records
from eyas.data.sources import (HUMANEVAL_FILE, OPENAI_ROLES, SkipLog, Skipped, _Bad, _content_id, _has_surrogates,
                               iter_conversations, iter_jsonl, normalize_messages, package_file)
from eyas.data.split import is_heldout
from eyas.errors import EyasError


def _prompt_record(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise _Bad("malformed record", "expected a JSON object")
    rid = obj.get("id", obj.get("question_id", obj.get("task_id")))
    if isinstance(obj.get("prompt"), str):
        turns = [obj["prompt"]]
    elif isinstance(obj.get("turns"), list) and obj["turns"] and all(isinstance(t, str) for t in obj["turns"]):
        turns = list(obj["turns"])
    elif "messages" in obj or "conversations" in obj:
        sharegpt = "conversations" in obj
        msgs = obj["conversations" if sharegpt else "messages"]
        try:
            turns = [m["content"] for m in _messages_for_prompts(msgs, sharegpt)]
        except _Bad:
            raise
    else:
        raise _Bad("malformed record", "expected 'prompt' (string) or 'turns' (list of strings)")
    for i, t in enumerate(turns):
        if _has_surrogates(t):
            raise _Bad("invalid UTF-8", f"turn {i} is not valid UTF-8")
        if not t.strip():
            raise _Bad("empty turn", f"turn {i} is empty")
    rec = {"id": str(rid) if rid is not None else _content_id(turns), "turns": turns}
    if "context" in obj:
        rec["context"] = _context(obj["context"])
        if rid is None:
            rec["id"] = _content_id([rec["context"], turns])
    return rec


def _context(raw) -> list[dict]:
    """A prompt record's fixed context: {"role": system|user|assistant, "content": str} messages, as written."""
    if not isinstance(raw, list):
        raise _Bad("malformed record", "'context' is not a list of messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in OPENAI_ROLES:
            raise _Bad("malformed record", f"context message {i}: expected {{\"role\": system|user|assistant, "
                                           f"\"content\": string}}")
        if _has_surrogates(m["content"]):
            raise _Bad("invalid UTF-8", f"context message {i} is not valid UTF-8")
        if m["role"] == "system" and i != 0:
            raise _Bad("misplaced system turn", f"context message {i}: a system message may only come first")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _messages_for_prompts(raw, sharegpt: bool):
    return [m for m in normalize_messages(raw, sharegpt=sharegpt) if m["role"] == "user"]


_REPORTED: set[str] = set()  # skip summaries already printed by load_prompts in this process


def load_prompts(name_or_path: str, *, heldout_fraction: float = 0.05, limit: int | None = None,
                 skips: SkipLog | None = None, keep=None) -> list[dict]:
    """Prompt records {"id": str, "turns": [user turn, ...]} for bench; a record may also carry "context": the
    messages before its first turn, fixed (a long chat's earlier turns as written), and "kind".

    `keep(record) -> bool` filters records before they count towards `limit`, so a filtered load stops as soon as
    it has `limit` records (bench's --max-prompt-tokens: reading every held-out ShareGPT conversation first was
    most of a bench's load time; docs/LOG.md).

    `sharegpt-heldout`: the user turns of the held-out ShareGPT conversations (the ones
    `prepare` never writes); `heldout:DATA`: the same for any conversation source DATA; `humaneval`: the 164
    HumanEval prompts; `long` (`long:DATA`): the held-out chats kept whole (context + last user turn) and long
    single user turns, at least 2,048 bytes of text (eyas.data.longprompts; bench keeps 2k-6k tokens; the whole
    source is read, then ordered); a .jsonl path: lines with `prompt` or `turns` (or `messages`), optionally
    `context`; a .json, .parquet or datasets.save_to_disk path: the user turns of its conversations.
    """
    if skips is None:  # our own log: one summary line at the end instead of a line per record
        own = SkipLog()
        try:
            return load_prompts(name_or_path, heldout_fraction=heldout_fraction, limit=limit, skips=own, keep=keep)
        finally:
            line = own.summary(name_or_path)
            if own.counts and line not in _REPORTED:  # `eyas run` loads a prompt set once per bench: say it once
                _REPORTED.add(line)
                print(line, file=sys.stderr)
    kept: list[dict] = []
    for rec in _records(name_or_path, heldout_fraction, skips, keep):
        kept.append(rec)
        if limit is not None and len(kept) >= limit:
            break
    return kept


def _records(name_or_path: str, heldout_fraction: float, skips: SkipLog, keep) -> Iterator[dict]:
    """load_prompts' records in order, read as they are asked for, those `keep` refuses left out."""
    kept = (lambda records: records) if keep is None else (lambda records: filter(keep, records))  # noqa: E731
    if name_or_path == "sharegpt-heldout" or name_or_path.startswith("heldout:"):
        data = "sharegpt" if name_or_path == "sharegpt-heldout" else name_or_path.split(":", 1)[1]
        held = (c for c in iter_conversations(data, skips) if is_heldout(c.split_key, heldout_fraction))
        yield from kept(_user_turns(c) for c in held)
    elif name_or_path == "long" or name_or_path.startswith("long:"):
        # ordered among the kept records: long_records applies keep itself
        yield from long_records("sharegpt" if name_or_path == "long" else name_or_path.split(":", 1)[1],
                                heldout_fraction, skips, keep)
    elif name_or_path == "humaneval":
        yield from kept(_humaneval())
    else:
        yield from kept(_prompt_file(name_or_path, skips))


def _user_turns(c) -> dict:
    return {"id": c.id, "turns": [m["content"] for m in c.messages if m["role"] == "user"]}


def _humaneval() -> Iterator[dict]:
    """The 164 HumanEval prompts, one turn each."""
    path = package_file(*HUMANEVAL_FILE)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise EyasError(f"{path}: cannot read HumanEval ({e})") from e
    for line in lines:
        if line.strip():
            obj = json.loads(line)
            yield {"id": obj["task_id"], "turns": [obj["prompt"]]}


def _prompt_file(name_or_path: str, skips: SkipLog) -> Iterator[dict]:
    """A .jsonl of prompt records, or the user turns of a file or directory of conversations."""
    path = Path(name_or_path)
    if not path.exists():
        raise EyasError(f"{name_or_path}: no such file (expected 'sharegpt-heldout', 'humaneval', 'long', a "
                        f".jsonl of prompts, or conversations: a .json, a .parquet or a datasets.save_to_disk "
                        f"directory)")
    if path.suffix in (".json", ".parquet") or path.is_dir():
        yield from (_user_turns(c) for c in iter_conversations(name_or_path, skips))
        return
    if path.suffix != ".jsonl":
        raise EyasError(f"{name_or_path}: unknown prompt format {path.suffix!r} (expected .jsonl, .json, .parquet "
                        f"or a datasets.save_to_disk directory)")
    for item in iter_jsonl(path):
        if isinstance(item, Skipped):
            skips.add(item)
            continue
        where = f"{path} line {item[0]}"
        try:
            yield _prompt_record(item[1], where)
        except _Bad as e:
            skips.add(Skipped(e.reason, where, e.detail))
