"""The prepare stage: conversations -> (regenerated) -> chat-template tokens + loss masks on disk.

Only the TRAIN split is written; held-out conversations (eyas.data.split) are counted and
skipped, so `bench --prompts sharegpt-heldout` never evaluates on training data. With
--regenerate every assistant turn (up to --max-turns, within --max-len tokens) is the target's own
reply, optionally N sampled reply sets per conversation (`<id>#s1..#sN`); --self-prompts adds
conversations whose user turn the target wrote itself (`magpie-<n>`). Skipped records and dropped
samples go to DIR/skipped.jsonl and one summary line on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import eyas.target  # load_target looked up at call time: tests patch it
from eyas.data.chat import TemplateError, Tokenized, check_chat_template, first_turn_framing, tokenize_conversations
from eyas.data.prepared import PreparedWriter, SKIPS, Sample
from eyas.data.regenerate import RegenConfig, RegenStats, make_backend
from eyas.data.sources import Conversation, Skipped, iter_records, resolve_data
from eyas.data.split import is_heldout, sample_id
from eyas.errors import EyasError
from eyas.target.meta import open_target_meta   # tokenizer, config and fingerprint: no weights loaded


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """Resolved options of `eyas prepare`."""

    target: str = "smollm2-135m"
    """Target model: embedded name, HF dir, hub id or GGUF path."""
    data: str = "sharegpt"
    """Conversations: `sharegpt`, a .json / .jsonl file (OpenAI messages or ShareGPT conversations), a .parquet file
    or a directory a Hugging Face dataset was saved to (docs/data.md)."""
    out: str
    """Output directory."""
    limit: int | None = None
    """Stop after this many kept training conversations (None: all)."""
    max_len: int = 2048
    """Truncate each conversation to this many tokens."""
    max_turns: int | None = None
    """Keep only the first N user turns (and their replies) of each conversation (None: all)."""
    heldout_fraction: float = 0.05
    """Fraction of conversation ids held out for bench (never written)."""
    regenerate: bool = False
    """Replace the assistant turns with the target's own replies."""
    batch_size: int = 16
    """Conversations per generation batch and per commit. With --server, a group is at least 4 x concurrency
    conversations: the group's requests are what is in flight, and it waits for its slowest conversation."""
    regen: RegenConfig = RegenConfig()
    """How the target generates text (the replies with --regenerate, the prompts with --self-prompts). Its fields are
    set by their own names: --regen-temperature, [prepare] regen_temperature, --set prepare.regen_temperature."""
    overwrite: bool = False
    """Delete an existing prepared directory instead of resuming it."""
    trust_remote_code: bool = False
    """Allow the target's remote code (HF dirs / hub ids only)."""

    def __post_init__(self):
        if self.limit is not None and self.limit < 1:
            raise EyasError(f"--limit must be >= 1, got {self.limit}")
        if self.max_len < 2:
            raise EyasError(f"--max-len must be >= 2, got {self.max_len}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise EyasError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.batch_size < 1:
            raise EyasError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_turns is not None and self.max_turns < 1:
            raise EyasError(f"--max-turns must be >= 1, got {self.max_turns}")
        r = self.regen
        if r.samples_per_prompt > 1 and not self.regenerate:
            raise EyasError("--samples-per-prompt > 1 needs --regenerate (the dataset has one reply per turn)")
        if r.regenerate_limit is not None and not self.regenerate:
            raise EyasError("--regenerate-limit needs --regenerate")
        if r.server and not self.regenerate:
            raise EyasError("--server is only used with --regenerate")

    @property
    def generates(self) -> bool:
        """Whether this run generates text with the target (replies or self-prompts)."""
        return self.regenerate or self.regen.self_prompts > 0

    def identity(self) -> dict:
        """The options that change the written data (a resume must match them). Paths, speed and the server's
        connection settings never do; the generation knobs only when the run generates, the replies' knobs only
        with --regenerate, the self-prompts' temperature only with --self-prompts."""
        d = asdict(self)
        for k in ("out", "overwrite", "batch_size", "trust_remote_code"):
            d.pop(k)
        regen = d.pop("regen")
        for k in ("concurrency", "timeout", "retries", "gen_batch", "regen_compile", "regen_fuse", "device"):
            regen.pop(k)
        if not self.regenerate:
            for k in ("server", "model", "regen_temperature", "regenerate_limit", "samples_per_prompt",
                      "greedy_sample"):
                regen.pop(k)
        if not self.regen.self_prompts:
            regen.pop("self_prompt_temperature")
        if self.generates:
            d["regen"] = regen
        return d


def first_turns(c: Conversation, n: int) -> Conversation:
    """The conversation cut before its (n+1)-th user turn."""
    users, cut = 0, len(c.messages)
    for i, m in enumerate(c.messages):
        if m["role"] == "user":
            users += 1
            if users > n:
                cut = i
                break
    return dataclasses.replace(c, messages=tuple(c.messages[:cut]))


def samples_of(c: Conversation, n: int) -> list[Conversation]:
    """n copies of a conversation to regenerate, with ids `<id>#s1..#sn` (the conversation itself when n == 1)."""
    return [c] if n == 1 else [dataclasses.replace(c, id=sample_id(c.id, k)) for k in range(1, n + 1)]


def check_max_len(tokenizer, max_len: int, where: str) -> None:
    """Refuse a max_len that cannot hold the template's framing of a first turn plus one user and one reply token."""
    try:
        framing = first_turn_framing(tokenizer)
    except TemplateError as e:
        raise EyasError(f"{where}: {e}") from e
    if max_len < framing + 2:
        raise EyasError(f"--max-len {max_len} is too short for {where}: its chat template frames a first turn with "
                        f"{framing} tokens (system prompt and user/assistant headers), so no reply token would fit; "
                        f"use --max-len >= {framing + 2}")


def _new_state() -> dict:
    return {"read": 0, "skipped": {}, "heldout": 0, "dropped": {}, "truncated": 0, "kept": 0, "conversations": 0,
            "tokens": 0, "trainable_tokens": 0, "sent_to_regeneration": 0, "self_prompts_done": 0, "regen": {}}


def _open_target(cfg: PrepareConfig, target):
    """`target`, or the one cfg names: with weights when this run generates locally, else tokenizer and config only."""
    if target is not None:
        return target
    if (cfg.regenerate and not cfg.regen.server) or cfg.regen.self_prompts:
        return eyas.target.load_target(cfg.target, device=cfg.regen.device, trust_remote_code=cfg.trust_remote_code)

    return open_target_meta(cfg.target, trust_remote_code=cfg.trust_remote_code, tensors=())


def run_prepare(cfg: PrepareConfig, target=None, *, progress: bool = True) -> dict:
    """Write the prepared TRAIN split of cfg.data into cfg.out; returns the manifest."""
    resolve_data(cfg.data)  # a missing file fails before the (slow) target load
    target = _open_target(cfg, target)
    name = f"target {getattr(target, 'name', cfg.target)}"
    check_chat_template(target.tokenizer, name)
    check_max_len(target.tokenizer, cfg.max_len, name)
    writer = PreparedWriter(cfg.out, identity={"config": cfg.identity(), "target": target.fingerprint},
                            overwrite=cfg.overwrite)
    if writer.complete:
        print(f"eyas prepare: {cfg.out} is already complete", file=sys.stderr)
        return writer.manifest
    run = _Preparation(cfg, target, writer, name, progress=progress)
    try:
        seen = run.read_source()
        run.write_self_prompts(seen)
    finally:
        run.close_bar()
    return run.finish()


class _Preparation:
    """One run of the prepare stage into an open writer, resumed from its committed state.

    `st` is that state as committed to disk (PreparedWriter.commit) and read back on resume: a dict of counts,
    its keys in `_new_state`'s order (they become the manifest's counts); `skipped` and `dropped` count
    records and samples by reason and go into it at each commit."""

    def __init__(self, cfg: PrepareConfig, target, writer: PreparedWriter, name: str, *, progress: bool):
        self.cfg, self.target, self.writer, self.name, self.tok = cfg, target, writer, name, target.tokenizer
        self.st = {**_new_state(), **(writer.state or {})}
        self.skipped, self.dropped = Counter(self.st["skipped"]), Counter(self.st["dropped"])
        self.template_errors: list[str] = []  # this run's (the first one names the failure if nothing is kept)
        self.backend = None
        if cfg.generates:
            self.backend = make_backend(cfg, target)
            self.backend.stats = RegenStats(**self.st["regen"])
        self.bar = None
        if progress:
            from tqdm import tqdm

            total = None if cfg.limit is None else cfg.limit + cfg.regen.self_prompts
            self.bar = tqdm(total=total, initial=self.st["conversations"], unit="conv", desc="prepare",
                            file=sys.stderr, dynamic_ncols=True, disable=None)
        # Conversations per regenerate call and commit. A server gets enough to keep `concurrency` requests in
        # flight while a group's slowest conversations finish; a kill loses at most one group's replies.
        self.group = (max(cfg.batch_size, 4 * cfg.regen.concurrency) if cfg.regen.server and cfg.regenerate
                      else cfg.batch_size)

    def drop(self, r: Skipped, counter: Counter | None = None) -> None:
        """Count a skipped record or dropped sample by reason (default: dropped) and log it to skipped.jsonl."""
        (self.dropped if counter is None else counter)[r.reason] += 1
        self.writer.log(r.reason, r.where, r.detail)

    def commit(self, consumed: int) -> None:
        """Make everything added so far durable, with the first `consumed` source records done."""
        self.st["skipped"], self.st["dropped"] = dict(self.skipped), dict(self.dropped)
        if self.backend is not None:
            self.st["regen"] = dataclasses.asdict(self.backend.stats)
        self.writer.commit(consumed, self.st)

    def done(self) -> bool:
        return self.cfg.limit is not None and self.st["conversations"] >= self.cfg.limit

    def read_source(self) -> int:
        """Process the source records not yet consumed, a group at a time, committing after each group; returns
        the source records consumed (what the self-prompts' commits record)."""
        cfg, st = self.cfg, self.st
        chunk: list[Conversation] = []
        done = self.done()
        seen = self.writer.consumed  # source records consumed so far
        for pos, rec in enumerate(iter_records(cfg.data)):
            if done:
                break
            if pos < self.writer.consumed:
                continue
            seen = pos + 1
            st["read"] += 1
            if isinstance(rec, Skipped):
                self.drop(rec, self.skipped)
                continue
            if is_heldout(rec.split_key, cfg.heldout_fraction):
                st["heldout"] += 1
                continue
            if cfg.max_turns is not None:
                rec = first_turns(rec, cfg.max_turns)
            chunk.append(rec)
            # never regenerate/tokenize past the limit: the chunk is at most what is still wanted
            want = self.group if cfg.limit is None else min(self.group, cfg.limit - st["conversations"])
            if len(chunk) >= want:
                self.process_source(chunk)
                chunk = []
                done = self.done()
                self.commit(seen)
        if chunk:
            self.process_source(chunk)
        self.commit(seen)
        return seen

    def process_source(self, convs: list[Conversation]) -> None:
        """Process source conversations; those within --regenerate-limit go to the target."""
        cfg, limit = self.cfg, self.cfg.regen.regenerate_limit
        n_regen = 0 if not cfg.regenerate else len(convs) if limit is None else \
            max(0, min(len(convs), limit - self.st["sent_to_regeneration"]))
        self.process(convs, n_regen, cfg.regen.samples_per_prompt)
        self.st["sent_to_regeneration"] += n_regen

    def write_self_prompts(self, seen: int) -> None:
        """Magpie: after the dataset, the target writes the self-prompt conversations not yet done, in groups."""
        r, st = self.cfg.regen, self.st
        while st["self_prompts_done"] < r.self_prompts:
            start = st["self_prompts_done"]
            n = min(self.group, r.self_prompts - start)
            prompts = self.backend.self_prompts(start, n, r.self_prompt_temperature)
            for p in prompts:
                if isinstance(p, Skipped):
                    self.drop(p)
            convs = [p for p in prompts if not isinstance(p, Skipped)]
            self.process(convs, len(convs), 1, temperature=0.0)
            st["self_prompts_done"] += n
            self.commit(seen)

    def process(self, convs: list[Conversation], n_regen: int, n_samples: int,
                temperature: float | None = None) -> None:
        """(Regenerate,) tokenize and append conversations; the first n_regen go to the target."""
        todo = [(k, j, s) for k, c in enumerate(convs[:n_regen]) for j, s in enumerate(samples_of(c, n_samples))]
        results = self.regenerate(todo, temperature) if todo else []
        items = list(zip([k for k, _, _ in todo], results)) + list(enumerate(convs))[n_regen:]
        if todo:
            self.log_regeneration()
        live = [r.messages for _, r in items if not isinstance(r, Skipped)]
        toks = iter(tokenize_conversations(self.tok, live, max_len=self.cfg.max_len))  # one batch call
        kept = {k for k, r in items if self.add(r, None if isinstance(r, Skipped) else next(toks))}
        self.st["conversations"] += len(kept)
        if self.bar is not None:
            self.bar.update(len(kept))

    def regenerate(self, todo: list[tuple[int, int, Conversation]], temperature: float | None) -> list:
        """The backend's results for (conversation, sample number j, sample) in order; with greedy_sample the first
        samples (j = 0) go in a greedy call of their own, the others at the run's temperature."""
        if temperature is not None or not self.cfg.regen.greedy_sample:
            return self.backend.regenerate([s for _, _, s in todo], temperature=temperature)
        results: list = [None] * len(todo)
        for greedy in (True, False):
            idx = [i for i, (_, j, _) in enumerate(todo) if (j == 0) == greedy]
            out = self.backend.regenerate([todo[i][2] for i in idx], temperature=0.0 if greedy else None)
            for i, r in zip(idx, out):
                results[i] = r
        return results

    def log_regeneration(self) -> None:
        """The backend's notes into skipped.jsonl; its generation rate on the progress bar."""
        backend = self.backend
        for note in backend.notes:
            self.writer.log(note.reason, note.where, note.detail)
        backend.notes.clear()
        if self.bar is not None and backend.stats.seconds:
            self.bar.set_postfix(gen_tok_s=f"{backend.stats.new_tokens / backend.stats.seconds:.0f}")

    def add(self, r: Conversation | Skipped, t: Tokenized | TemplateError | None) -> bool:
        """Add one (regenerated) conversation, tokenized as `t`, as a sample; False when it is dropped instead."""
        if isinstance(r, Skipped):
            self.drop(r)
            return False
        if isinstance(t, TemplateError):
            self.drop(Skipped("chat template error", r.where, f"{r.id}: {t}"))
            self.template_errors.append(f"{r.where}: {t}")
            return False
        if not any(t.loss_mask):
            self.drop(Skipped("no trainable tokens", r.where, f"{r.id}: no assistant token within max-len"))
            return False
        self.writer.add(Sample(r.id, t.input_ids, t.loss_mask))
        st = self.st
        st["kept"] += 1
        st["truncated"] += t.truncated
        st["tokens"] += len(t.input_ids)
        st["trainable_tokens"] += sum(t.loss_mask)
        return True

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def finish(self) -> dict:
        """Refuse an empty dataset that the chat template caused, else write the manifest and say what was lost."""
        st, dropped, writer = self.st, self.dropped, self.writer
        if not st["kept"] and dropped.get("chat template error"):
            # a template that fails on every conversation: refuse to finish an empty dataset (the directory stays
            # incomplete, so nothing reads it as prepared)
            first = f"; first: {self.template_errors[0]}" if self.template_errors else ""
            writer.close()
            raise EyasError(f"{self.name}: its chat template failed on every conversation "
                            f"({dropped['chat template error']}){first}; nothing prepared (details in "
                            f"{writer.dir / SKIPS})")
        counts = {k: v for k, v in st.items() if k not in ("regen", "skipped", "dropped")}
        counts.update(skipped=dict(self.skipped), dropped=dict(dropped))
        if self.backend is not None:
            counts.update(self.backend.stats.as_dict())
        fmt = {"file": "samples.jsonl",
               "record": "{id, input_ids, trainable: [[start, end), ...] token ranges with loss_mask 1}",
               "skipped": f"{SKIPS}: {{reason, where, detail}} per skipped record / dropped sample"}
        manifest = {"config": asdict(self.cfg), "target": self.target.fingerprint, "counts": counts,
                    "heldout_fraction": self.cfg.heldout_fraction, "format": fmt}
        manifest = writer.finish(manifest)
        line = problem_summary(counts, writer.dir / SKIPS)
        if line:
            print(line, file=sys.stderr)
        return manifest


def _by_reason(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


def problem_summary(counts: dict, log) -> str | None:
    """One line for stderr: skipped records, dropped samples and empty replies by reason (details in `log`)."""
    parts = []
    if counts["skipped"]:
        parts.append(f"skipped {sum(counts['skipped'].values())} of {counts['read']} records "
                     f"({_by_reason(counts['skipped'])})")
    if counts["dropped"]:
        parts.append(f"dropped {sum(counts['dropped'].values())} samples ({_by_reason(counts['dropped'])})")
    if counts.get("empty_replies"):
        parts.append(f"{counts['empty_replies']} regenerated replies were empty (not trained on: each conversation "
                     "is cut before its empty reply)")
    return f"eyas prepare: {'; '.join(parts)}; details in {log}" if parts else None


def skipped_lines(path) -> list[str]:
    """The records of a skipped.jsonl as `eyas: skipped (reason) where: detail` lines, for --verbose."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                out.append(f"eyas: skipped ({r['reason']}) {r['where']}: {r['detail']}")
            except (ValueError, KeyError, TypeError):
                out.append(f"eyas: {path}:{n}: unreadable skip record")
    return out


def format_counts(counts: dict) -> str:
    """One readable block for the CLI."""
    lines = [f"read {counts['read']}  kept {counts['kept']} samples of {counts['conversations']} "
             f"conversations  held out {counts['heldout']}  truncated {counts['truncated']}",
             f"tokens {counts['tokens']}  trainable tokens {counts['trainable_tokens']}"]
    for name in ("skipped", "dropped"):
        if counts[name]:
            lines.append(f"{name}: " + _by_reason(counts[name]))
    if "regenerated_turns" in counts:
        lines.append(f"regenerated turns {counts['regenerated_turns']}  cut at max-new-tokens "
                     f"{counts['replies_cut_at_max_new_tokens']}  cut at max-len {counts['replies_cut_at_max_len']}  "
                     f"empty {counts['empty_replies']}  generated tokens {counts['generated_tokens']}"
                     f"  ({counts['generation_tokens_per_s']} tok/s)")
    if counts.get("self_prompts_written"):
        lines.append(f"self-prompts written {counts['self_prompts_written']}  cut {counts['self_prompts_cut']}")
    return "\n".join(lines)
