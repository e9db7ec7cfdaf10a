"""Bench prompts: loading a prompt set with the token-length filter, encoding a record's turns with the chat
template (a record's fixed `context` first, as written), and the per-prompt summary of the report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eyas.data.chat import encode_prompt
from eyas.data.prompts import load_prompts
from eyas.errors import EyasError

if TYPE_CHECKING:
    from eyas.bench.bench import BenchConfig


def first_messages(rec: dict) -> list[dict]:
    """A record's first prompt as chat messages: its fixed context (if any), then its first user turn."""
    return [*rec.get("context", ()), {"role": "user", "content": rec["turns"][0]}]


def load_bench_prompts(cfg: BenchConfig, tokenizer=None, counts: dict | None = None) -> tuple[list[dict], int]:
    """Prompt records and how many were skipped for a first prompt over cfg.max_prompt_tokens; `counts`, if
    given, gets {"too_long": n, "too_short": n} (under cfg.min_prompt_tokens). Lengths: context + first turn,
    chat template applied."""
    lo, hi = cfg.min_prompt_tokens, cfg.max_prompt_tokens
    n = counts if counts is not None else {}
    n.update(too_long=0, too_short=0)

    def in_range(r: dict) -> bool:
        size = len(encode_prompt(tokenizer, first_messages(r)))
        why = "too_long" if hi is not None and size > hi else "too_short" if lo is not None and size < lo else None
        if why:
            n[why] += 1
        return why is None

    filtering = (lo is not None or hi is not None) and tokenizer is not None
    recs = load_prompts(cfg.prompts, limit=cfg.limit, keep=in_range if filtering else None)
    if cfg.max_turns is not None:
        recs = [{**r, "turns": r["turns"][:cfg.max_turns]} for r in recs]
    if not recs:
        bounds = (f" of {lo} to {hi} tokens" if None not in (lo, hi) else f" of at least {lo} tokens" if lo
                  else f" of at most {hi} tokens")
        raise EyasError(f"{cfg.prompts}: no prompts" + (bounds if n["too_long"] or n["too_short"] else ""))
    return recs, n["too_long"]


def prompt_ids(tok, msgs, room) -> tuple[list[int], bool]:
    """Token ids of `msgs` with the generation prompt, left-truncated to `room` (and whether they were)."""
    ids = encode_prompt(tok, msgs)
    return (ids[-room:], True) if len(ids) > room else (ids, False)


def prompt_summary(records: list[dict], tok) -> dict:
    """First-prompt lengths in tokens (context + first turn, chat template applied, before any left-truncation)
    and the records per kind (records of the `long` set carry one)."""
    sizes = sorted(len(encode_prompt(tok, first_messages(r))) for r in records)
    kinds: dict[str, int] = {}
    for r in records:
        if "kind" in r:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return {"tokens": {"min": sizes[0], "median": sizes[len(sizes) // 2], "max": sizes[-1]}, "kinds": kinds}


def tau_by_kind(report: dict, records: list[dict]) -> None:
    """Each method's tau over the records of each kind (from per_record), when the records have kinds."""
    if not report["prompts"]["kinds"]:
        return
    for m in report["methods"].values():
        by: dict[str, list[int]] = {}
        for r, (tok, fw) in zip(records, m["per_record"]):
            t = by.setdefault(r.get("kind", "-"), [0, 0])
            t[0], t[1] = t[0] + tok, t[1] + fw
        m["tau_by_kind"] = {k: round(t / max(f, 1), 4) for k, (t, f) in by.items()}
