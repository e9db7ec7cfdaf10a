"""The prepare stage: conversations -> (regenerated) -> chat-template tokens + loss masks on disk.

Only the TRAIN split is written; held-out conversations (eyas.data.split) are counted and
skipped, so `bench --prompts sharegpt-heldout` never evaluates on training data.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from dataclasses import asdict, dataclass

from eyas.data.chat import TemplateError, check_chat_template, tokenize_conversation
from eyas.data.prepared import PreparedWriter, Sample
from eyas.data.sources import Conversation, SkipLog, Skipped, iter_records, resolve_data
from eyas.errors import EyasError


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """Resolved options of `eyas prepare`."""

    target: str = "smollm2-135m"
    """Target model: embedded name, HF dir, hub id or GGUF path."""
    data: str = "sharegpt"
    """Conversations: `sharegpt` or a .json (ShareGPT) / .jsonl (OpenAI messages) path."""
    out: str
    """Output directory."""
    limit: int | None = None
    """Stop after this many kept training conversations (None: all)."""
    max_len: int = 2048
    """Truncate each conversation to this many tokens."""
    heldout_fraction: float = 0.05
    """Fraction of conversation ids held out for bench (never written)."""
    regenerate: bool = False
    """Replace the assistant turns with the target's own replies."""
    regenerate_limit: int | None = None
    """With --regenerate: regenerate only the first N conversations sent to the target; the later ones keep
    the dataset's replies (their labels still come from the target at training time), so a fixed generation
    budget buys more distinct training text (None: regenerate all)."""
    server: str | None = None
    """OpenAI-compatible server URL for regeneration (None: generate locally)."""
    model: str | None = None
    """Model name on the server (None: the server's first model)."""
    concurrency: int = 8
    """Requests in flight to the server."""
    timeout: float = 120.0
    """Seconds per server request."""
    retries: int = 3
    """Retries per server request (exponential backoff)."""
    temperature: float = 0.0
    """0: greedy regeneration; > 0: sampled."""
    max_new_tokens: int = 512
    """Longest regenerated reply."""
    batch_size: int = 16
    """Conversations per generation batch and per commit."""
    gen_batch: int | None = None
    """Rows per local generation forward (default: batch_size). A larger batch_size with a smaller
    gen_batch sorts more prompts by length before batching them, so less of each forward is padding."""
    regen_dtype: str | None = None
    """Weights dtype of local regeneration: fp32, bf16 or fp16 (None: the target's). bf16 is ~2x faster on
    CPUs with AVX512-BF16/AMX; the replies are then the bf16 target's, which is still the target's style."""
    max_turns: int | None = None
    """Keep only the first N user turns (and their replies) of each conversation (None: all)."""
    seed: int = 0
    """Seed for sampled regeneration."""
    overwrite: bool = False
    """Delete an existing prepared directory instead of resuming it."""
    trust_remote_code: bool = False
    """Allow the target's remote code (HF dirs / hub ids only)."""

    def __post_init__(self):
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.max_len < 2:
            raise ValueError(f"--max-len must be >= 2, got {self.max_len}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.concurrency < 1 or self.retries < 0:
            raise ValueError("--max-new-tokens, --batch-size and --concurrency must be >= 1, --retries >= 0")
        if self.gen_batch is not None and self.gen_batch < 1:
            raise ValueError(f"--gen-batch must be >= 1, got {self.gen_batch}")
        if self.regen_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"--regen-dtype {self.regen_dtype!r}: expected fp32, bf16 or fp16")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        if self.regenerate_limit is not None and (self.regenerate_limit < 0 or not self.regenerate):
            raise ValueError("--regenerate-limit must be >= 0 and needs --regenerate")
        if self.server and not self.regenerate:
            raise ValueError("--server is only used with --regenerate")

    def identity(self) -> dict:
        """The options that change the written data (a resume must match them)."""
        d = asdict(self)
        for k in ("out", "overwrite", "concurrency", "timeout", "retries", "batch_size", "gen_batch", "trust_remote_code"):
            d.pop(k)
        if not self.regenerate:
            for k in ("server", "model", "temperature", "max_new_tokens", "seed", "regen_dtype", "regenerate_limit"):
                d.pop(k)
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


def _new_state() -> dict:
    return {"read": 0, "skipped": {}, "heldout": 0, "dropped": {}, "truncated": 0, "kept": 0,
            "tokens": 0, "trainable_tokens": 0}


def run_prepare(cfg: PrepareConfig, target=None, *, progress: bool = True) -> dict:
    """Write the prepared TRAIN split of cfg.data into cfg.out; returns the manifest."""
    from eyas.data.split import is_heldout

    resolve_data(cfg.data)  # a missing file fails before the (slow) target load
    if target is None:
        from eyas.target import load_target

        target = load_target(cfg.target, trust_remote_code=cfg.trust_remote_code)
    check_chat_template(target.tokenizer, f"target {cfg.target}")
    tok = target.tokenizer
    writer = PreparedWriter(cfg.out, identity={"config": cfg.identity(), "target": target.fingerprint},
                            overwrite=cfg.overwrite)
    if writer.complete:
        print(f"eyas prepare: {cfg.out} is already complete", file=sys.stderr)
        return writer.manifest
    st = writer.state or _new_state()
    skipped, dropped = Counter(st["skipped"]), Counter(st["dropped"])
    skips = SkipLog()
    backend = None
    if cfg.regenerate:
        from eyas.data.regenerate import make_backend

        backend = make_backend(cfg, target)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.limit, initial=st["kept"], unit="conv", desc="prepare", file=sys.stderr,
                   dynamic_ncols=True, disable=None)

    def drop(reason: str, c: Conversation, detail: str) -> None:
        dropped[reason] += 1
        skips.add(Skipped(reason, c.where, detail))

    def process(chunk: list[tuple[int, Conversation]]) -> None:
        """(Regenerate,) tokenize and append a chunk of training conversations."""
        convs = [c for _, c in chunk]
        n_regen = 0 if backend is None else len(convs) if cfg.regenerate_limit is None else \
            max(0, min(len(convs), cfg.regenerate_limit - st.get("sent_to_regeneration", 0)))
        results = list(convs)
        if n_regen:
            results[:n_regen] = backend.regenerate(convs[:n_regen])
            st["sent_to_regeneration"] = st.get("sent_to_regeneration", 0) + n_regen
            if bar is not None and backend.stats.seconds:
                bar.set_postfix(gen_tok_s=f"{backend.stats.new_tokens / backend.stats.seconds:.0f}")
        for c, r in zip(convs, results):
            if isinstance(r, Skipped):
                dropped[r.reason] += 1
                skips.add(r)
                continue
            try:
                t = tokenize_conversation(tok, r.messages, max_len=cfg.max_len)
            except TemplateError as e:
                drop("chat template error", c, str(e))
                continue
            if not any(t.loss_mask):
                drop("no trainable tokens", c, "no assistant token within max-len")
                continue
            writer.add(Sample(c.id, t.input_ids, t.loss_mask))
            st["kept"] += 1
            st["truncated"] += t.truncated
            st["tokens"] += len(t.input_ids)
            st["trainable_tokens"] += sum(t.loss_mask)
            if bar is not None:
                bar.update(1)

    def commit(consumed: int) -> None:
        st["skipped"], st["dropped"] = dict(skipped), dict(dropped)
        writer.commit(consumed, st)

    chunk: list[tuple[int, Conversation]] = []
    done = cfg.limit is not None and st["kept"] >= cfg.limit
    seen = writer.consumed  # source records consumed so far
    try:
        for pos, rec in enumerate(iter_records(cfg.data)):
            if done:
                break
            if pos < writer.consumed:
                continue
            seen = pos + 1
            st["read"] += 1
            if isinstance(rec, Skipped):
                skipped[rec.reason] += 1
                skips.add(rec)
                continue
            if is_heldout(rec.split_key, cfg.heldout_fraction):
                st["heldout"] += 1
                continue
            if cfg.max_turns is not None:
                rec = first_turns(rec, cfg.max_turns)
            chunk.append((pos, rec))
            # never regenerate/tokenize past the limit: the chunk is at most what is still wanted
            want = cfg.batch_size if cfg.limit is None else min(cfg.batch_size, cfg.limit - st["kept"])
            if len(chunk) >= want:
                process(chunk)
                chunk = []
                done = cfg.limit is not None and st["kept"] >= cfg.limit
                commit(seen)
        if chunk:
            process(chunk)
        commit(seen)
    finally:
        if bar is not None:
            bar.close()
    counts = {**st, "skipped": dict(skipped), "dropped": dict(dropped)}
    if backend is not None:
        counts.update(backend.stats.as_dict())
    manifest = {"config": asdict(cfg), "target": target.fingerprint, "counts": counts,
                "heldout_fraction": cfg.heldout_fraction,
                "format": {"file": "samples.jsonl",
                           "record": "{id, input_ids, trainable: [[start, end), ...] token ranges with loss_mask 1}"}}
    return writer.finish(manifest)


def format_counts(counts: dict) -> str:
    """One readable block for the CLI."""
    lines = [f"read {counts['read']}  kept {counts['kept']}  held out {counts['heldout']}  "
             f"truncated {counts['truncated']}",
             f"tokens {counts['tokens']}  trainable tokens {counts['trainable_tokens']}"]
    for name in ("skipped", "dropped"):
        if counts[name]:
            lines.append(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts[name].items())))
    if "regenerated_turns" in counts:
        lines.append(f"regenerated turns {counts['regenerated_turns']}  cut at max-new-tokens "
                     f"{counts['replies_cut_at_max_new_tokens']}  generated tokens {counts['generated_tokens']}"
                     f"  ({counts['generation_tokens_per_s']} tok/s)")
    return "\n".join(lines)
