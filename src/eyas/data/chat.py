"""Chat-template tokenization with assistant loss masks, derived from the template itself.

For each assistant turn i the template is rendered twice: the prefix messages[:i] with the
generation prompt (what a server feeds the model), and messages[:i+1] (the prefix plus the
reply). Both must be prefixes of the full rendering. The characters between the two are what
the model generates for that turn: the reply text, then the template's closing text. The
trainable span is the reply plus the first special token that closes it (`<|im_end|>` for
ChatML, `<|eot_id|>` for Llama-3); whitespace the template adds after that token is not
trained. No separator string is hard-coded. Tokens are then marked by their character offsets:
a token is trainable when it starts inside a span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from eyas.errors import EyasError


class TemplateError(Exception):
    """The chat template cannot render this conversation (counted as a skip by prepare)."""


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]  # 1: assistant text or the end-of-turn token that closes it
    truncated: bool       # cut to max_len


def check_chat_template(tokenizer, where: str = "target") -> None:
    if tokenizer is None:
        raise EyasError(f"{where}: has no tokenizer; prepare needs one with a chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise EyasError(f"{where}: the tokenizer has no chat template (set tokenizer.chat_template)")


def special_strings(tokenizer) -> list[str]:
    """Text of every special token (longest first, so overlapping names resolve to the longest)."""
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content) if hasattr(tok, "content") else str(tok))
    return sorted((s for s in out if s), key=len, reverse=True)


def render(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises whatever the template author chose (TemplateError, ValueError, ...)
        raise TemplateError(f"chat template failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if not isinstance(text, str):
        raise TemplateError("chat template did not return text")
    return text


def _reply_end(reply: str, content: str, specials: list[str]) -> int:
    """Length of the trainable part of `reply` = rendered reply text + its closing special token."""
    body = content.strip()
    k = reply.find(body) if body else -1
    after = k + len(body) if k >= 0 else 0
    best = None
    for s in specials:  # the earliest special token after the reply text; longest wins ties
        j = reply.find(s, after)
        if j >= 0 and (best is None or j < best[0]):
            best = (j, j + len(s))
    return best[1] if best else len(reply.rstrip())


def assistant_spans(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans [start, end) of each assistant reply."""
    text = render(tokenizer, messages)
    specials = special_strings(tokenizer)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not upto.startswith(prompt) or not text.startswith(upto):
            raise TemplateError(f"chat template is not prefix-stable at turn {i} "
                                "(rendering a prefix of the conversation changes earlier text)")
        reply = upto[len(prompt):]
        end = _reply_end(reply, m["content"], specials)
        if end > 0:
            spans.append((len(prompt), len(prompt) + end))
    return text, spans


def _mask(ids: list[int], offsets, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token that starts inside a span (by its character offset); empty-width tokens are 0."""
    inside = bytearray(len(text) + 1)
    for s, e in spans:
        inside[s:e] = b"\x01" * (e - s)
    return [inside[a] if b > a else 0 for a, b in offsets]


def _split_tokenize(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Without offsets (slow tokenizers): tokenize the pieces between span boundaries separately."""
    ids, mask, pos = [], [], 0
    for s, e in spans + [(len(text), len(text))]:
        for piece, flag in ((text[pos:s], 0), (text[s:e], 1)):
            if piece:
                part = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += part
                mask += [flag] * len(part)
        pos = e
    return ids, mask


def _cut(ids: list[int], mask: list[int], max_len: int | None) -> Tokenized:
    truncated = max_len is not None and len(ids) > max_len
    return Tokenized(ids[:max_len], mask[:max_len], True) if truncated else Tokenized(ids, mask, False)


def _trimmed(messages: Sequence[dict]) -> list[dict]:
    """Trailing non-assistant turns dropped (nothing after the last reply is trained on)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return list(messages[: last + 1])


def tokenize_conversation(tokenizer, messages: Sequence[dict], *, max_len: int | None = None) -> Tokenized:
    """Token ids and loss mask for one conversation (trailing non-assistant turns are dropped)."""
    out = tokenize_conversations(tokenizer, [messages], max_len=max_len)[0]
    if isinstance(out, TemplateError):
        raise out
    return out


def tokenize_conversations(tokenizer, conversations: Sequence[Sequence[dict]], *,
                           max_len: int | None = None) -> list[Tokenized | TemplateError]:
    """tokenize_conversation for many: each is rendered alone, and a fast tokenizer encodes them in one batch
    call (its own threads). A conversation the template cannot render gives its TemplateError in its place."""
    rendered: list[tuple[str, list[tuple[int, int]]] | TemplateError] = []
    for messages in conversations:
        try:
            rendered.append(assistant_spans(tokenizer, _trimmed(messages)))
        except TemplateError as e:
            rendered.append(e)
    ok = [r for r in rendered if not isinstance(r, TemplateError)]
    if getattr(tokenizer, "is_fast", False) and ok:
        enc = tokenizer([text for text, _ in ok], add_special_tokens=False, return_offsets_mapping=True)
        done = iter([_cut(list(ids), _mask(ids, offs, text, spans), max_len)
                     for ids, offs, (text, spans) in zip(enc["input_ids"], enc["offset_mapping"], ok)])
    else:
        done = iter([_cut(*_split_tokenize(tokenizer, text, spans), max_len) for text, spans in ok])
    return [r if isinstance(r, TemplateError) else next(done) for r in rendered]


def encode_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of messages + the generation prompt (what the model continues from)."""
    out = encode_prompts(tokenizer, [messages])[0]
    if isinstance(out, TemplateError):
        raise out
    return out


def encode_prompts(tokenizer, prompts: Sequence[Sequence[dict]]) -> list[list[int] | TemplateError]:
    """encode_prompt for many, in one tokenizer call; a prompt the template cannot render gives its TemplateError."""
    texts: list[str | TemplateError] = []
    for messages in prompts:
        try:
            texts.append(render(tokenizer, messages, add_generation_prompt=True))
        except TemplateError as e:
            texts.append(e)
    ok = [t for t in texts if isinstance(t, str)]
    ids = iter(tokenizer(ok, add_special_tokens=False)["input_ids"] if ok else [])
    return [t if isinstance(t, TemplateError) else list(next(ids)) for t in texts]


_PROBE = "EYASPROBEUSERTURN"


def _probe_split(tokenizer) -> tuple[str, str]:
    """The rendering of one user turn + the generation prompt, split around the user's text."""
    text = render(tokenizer, [{"role": "user", "content": _PROBE}], add_generation_prompt=True)
    if text.count(_PROBE) != 1:
        raise TemplateError("chat template does not render a user turn's text verbatim")
    before, after = text.split(_PROBE)
    return before, after


def user_header(tokenizer) -> list[int]:
    """Token ids the template puts before the text of a first user turn (BOS, a default system prompt,
    the user header): what a Magpie-style self-prompt continues from."""
    before, _ = _probe_split(tokenizer)
    return list(tokenizer(before, add_special_tokens=False)["input_ids"])


def first_turn_framing(tokenizer) -> int:
    """Tokens the template adds around a first user turn up to the reply (headers, a default system prompt,
    the end of the user turn and the assistant header)."""
    before, after = _probe_split(tokenizer)
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (before, after) if t)
