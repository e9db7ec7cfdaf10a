"""The `long` prompt set: held-out chats kept whole, 2k-6k target tokens, for bench.

The ShareGPT copy eyas ships cuts a long chat into parts `<id>_<N>`, N being the turn the part starts at;
most parts repeat the previous part's last assistant turn as their first turn, and some parts are missing.
The parts of one chat share one split key, so a chat is held out, or trained on, as a whole
(eyas.data.split; `prepare` skips exactly the held-out keys). This set reads the held-out chats only and
joins their consecutive parts back together: a part that starts where the chat ended, or one turn earlier
with that same turn, continues it (the repeat dropped); any other part starts a new chat.

Two kinds of record, both real held-out text, nothing made up:
- "conversation": a chat with an assistant turn before its last user turn. That last user turn is the
  record's one turn (the model writes the final reply); everything before it, earlier assistant turns as
  written, is the record's fixed `context`.
- "document": one user turn that is long alone (at least LONG_TOKENS[0] bytes), with the chat's system
  message, if any, as its context: in this data a pasted text (an article, a chapter, a log, code) with a
  request to summarise, fix or answer questions on it. Such a turn can also sit inside a conversation's
  context; the conversation then asks about it later.
The order spreads any first N over both kinds and over lengths (long_records).

Length: the set is 2,048-6,144 tokens of the target's tokenizer (LONG_TOKENS), chat template applied to
context + turn. This module does not know the tokenizer, so it keeps the chats with at least
LONG_TOKENS[0] UTF-8 bytes of text (a byte-level BPE token holds at least one byte: a cheap necessary
condition up to the template's few tokens); bench's min_prompt_tokens / max_prompt_tokens, which default
to LONG_TOKENS for this set, count the tokens.
"""

from __future__ import annotations

import re
from typing import Iterator

from eyas.data.sources import Skipped, data_format, iter_raw, normalize_messages, resolve_data, to_conversation
from eyas.data.split import is_heldout

LONG_TOKENS = (2048, 6144)
"""The long set's prompt length range in target tokens (chat template applied), both ends kept."""
CONVERSATION_BYTES = (12_000, 19_000)
"""Bounds of the conversations' length classes in UTF-8 bytes: about 3k and 4.5k tokens at 4 bytes a token."""

_PART = re.compile(r"^.+_(?P<n>\d+)$")


def is_long_set(name: str) -> bool:
    """True for `long` and `long:DATA`."""
    return name == "long" or name.startswith("long:")


def _offset(conv, sharegpt: bool) -> int | None:
    """The turn a ShareGPT part starts at (its `_N`), None for a record that is not a part."""
    if not sharegpt or conv.split_key == conv.id:
        return None
    m = _PART.match(conv.id)
    return int(m.group("n")) if m else None


def heldout_chats(data: str, fraction: float, skips) -> Iterator[tuple[str, tuple[dict, ...]]]:
    """(id, messages) of every held-out chat of `data`, consecutive ShareGPT parts joined, in file order.

    A joined chat's id is "<first part id>..<last part id>"; a chat of one part keeps the part's id and
    its messages as `iter_conversations` gives them."""
    path = resolve_data(data)
    sharegpt = data_format(path) == "json"   # ShareGPT's parts are joined; other sources' records are whole chats
    chat = None   # {"key", "ids", "messages" (validated, one part), "raw" (ShareGPT turns), "next" (turn offset)}

    def emit():
        if len(chat["ids"]) == 1:
            return chat["ids"][0], chat["messages"]
        # each part passed alone and no later part starts with a system turn, so the joined turns pass too;
        # a later part's leading assistant turn (dropped from the part alone) is the chat's own and kept
        return f"{chat['ids'][0]}..{chat['ids'][-1]}", normalize_messages(chat["raw"], sharegpt=True)

    for item in iter_raw(path):
        if isinstance(item, Skipped):
            skips.add(item)
            continue
        where, obj = item
        rec = to_conversation(obj, where, default_sharegpt=sharegpt)
        if isinstance(rec, Skipped):
            skips.add(rec)
            continue
        if not is_heldout(rec.split_key, fraction):
            continue
        start = _offset(rec, sharegpt)
        raw = obj.get("conversations") if start is not None else None
        if (chat is not None and raw and chat["next"] is not None and chat["key"] == rec.split_key
                and raw[0]["from"] != "system"):
            # the part continues the chat where it ended, or repeats the chat's last turn first
            repeat = start == chat["next"] - 1 and chat["raw"] and raw[0] == chat["raw"][-1]
            if start == chat["next"] or repeat:
                chat["ids"].append(rec.id)
                chat["raw"] = chat["raw"] + list(raw[1:] if repeat else raw)
                chat["next"] = start + len(raw)
                continue
        if chat is not None:
            yield emit()
        chat = {"key": rec.split_key, "ids": [rec.id], "messages": rec.messages, "raw": list(raw or ()),
                "next": None if not raw else start + len(raw)}
    if chat is not None:
        yield emit()


def chat_records(cid: str, messages) -> Iterator[dict]:
    """A chat's prompt records, in chat order: a "document" for each user turn that is long alone
    (LONG_TOKENS[0] bytes), the chat's system message if any as its context; then, when an assistant turn comes
    before the last user turn, the "conversation": the messages before that turn as `context`, the turn itself."""
    system = [dict(messages[0])] if messages[0]["role"] == "system" else []
    for i, m in enumerate(messages):
        if m["role"] == "user" and _bytes(m["content"]) >= LONG_TOKENS[0]:
            yield {"id": f"{cid}@{i}", "kind": "document", "context": system, "turns": [m["content"]]}
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    context = [dict(m) for m in messages[:last]]
    if any(m["role"] == "assistant" for m in context) and \
            sum(_bytes(m["content"]) for m in messages[:last + 1]) >= LONG_TOKENS[0]:
        yield {"id": cid, "kind": "conversation", "context": context, "turns": [messages[last]["content"]]}


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def long_records(data: str, fraction: float, skips, keep=None) -> Iterator[dict]:
    """The long set's records of `data` that `keep` keeps (bench's token filter), ordered so that any first N
    spreads over kinds and lengths: documents and conversations alternate while both last, and the
    conversations cycle through three length classes (CONVERSATION_BYTES); each queue in file order. Reads
    the whole source first."""
    docs: list[dict] = []
    convs: list[list[dict]] = [[] for _ in range(len(CONVERSATION_BYTES) + 1)]
    for cid, msgs in heldout_chats(data, fraction, skips):
        for rec in chat_records(cid, msgs):
            if keep is None or keep(rec):
                if rec["kind"] == "document":
                    docs.append(rec)
                else:
                    size = sum(_bytes(m["content"]) for m in rec["context"]) + _bytes(rec["turns"][0])
                    convs[sum(size >= b for b in CONVERSATION_BYTES)].append(rec)
    yield from _deal([docs, list(_deal(convs))])


def _deal(queues: list[list[dict]]) -> Iterator[dict]:
    """One item from each non-empty queue in turn until all are empty."""
    for i in range(max(map(len, queues), default=0)):
        for q in queues:
            if i < len(q):
                yield q[i]
