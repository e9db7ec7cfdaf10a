"""Self-distillation: replace every assistant turn with the target's own reply, turn by turn.

User (and system) turns are kept; reply k is generated from the conversation with replies
0..k-1 already replaced, so the data follows the target's own distribution (the EAGLE-3 paper
regenerates before training). An empty reply (whitespace, or a server's unskipped special tokens only) is
never kept: the conversation is cut before it (dropped when it was the first) and counted. Two backends behind one interface,
`regenerate(convs, temperature=None) -> list[Conversation | Skipped]`:

* `LocalBackend`: batched generation with the loaded target through `Runner.from_hf`: the static-cache
  runner for Llama-family targets, the generic `HFRunner` (target/hf_runner.py) for other full-attention
  ones, else (a target neither takes) HF `model.generate`.
* `ServerBackend`: any OpenAI-compatible chat-completions server (SGLang, vLLM, ...), through eyas/serving.py:
  timeouts, retries with exponential backoff and a bounded number of requests in flight.

The local backend also writes Magpie-style prompts (`self_prompts`): the target continues the
chat template's user header and its sampled text becomes a new conversation's user turn.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from eyas.data.chat import TemplateError, encode_prompts, special_strings, user_header
from eyas.data.sources import Conversation, Skipped
from eyas.errors import EyasError
from eyas.serving import Client, ServerError, TIMEOUT, retrying
from eyas.target.runner import Runner


@dataclass(frozen=True, kw_only=True)
class RegenConfig:
    """How `eyas prepare` generates text with the target: the regenerated replies (--regenerate) and the self-written
    prompts (--self-prompts), locally or through a server (PrepareConfig.regen)."""

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
    regen_temperature: float = 0.0
    """Temperature of regenerated replies: 0 greedy, > 0 sampled."""
    samples_per_prompt: int = 1
    """With --regenerate: N regenerated reply sets per conversation (ids `<id>#s1..#sN`, sampled at
    regen_temperature > 0); every sample stays on its conversation's side of each split."""
    greedy_sample: bool = False
    """With samples_per_prompt > 1: the first reply set (`#s1`) is greedy and the others are sampled, so the data
    hold the texts a greedy decoder meets beside the sampled variety (the trainer's eval scores `#s1` only)."""
    self_prompts: int = 0
    """Also write N Magpie-style conversations `magpie-<n>`: the user turn sampled by the target from the chat
    template's user header (at self_prompt_temperature), the reply greedy. Local generation only."""
    self_prompt_temperature: float = 1.0
    """Temperature of the self-written user turns (> 0)."""
    max_new_tokens: int = 512
    """Longest regenerated reply."""
    gen_batch: int | None = None
    """Rows per local generation forward (default: batch_size). A larger batch_size with a smaller
    gen_batch sorts more prompts by length before batching them, so less of each forward is padding."""
    regen_compile: bool = False
    """Local regeneration: torch.compile the decode step once for every batch and slot count (dynamic shapes),
    so each CUDA-graphed step replays fused kernels instead of ~35 small ones per layer. Costs one compile up
    front; like gen_batch it changes speed, not the data (up to bf16 rounding)."""
    regen_fuse: bool = False
    """Local regeneration: compile each decoder layer's norms, projections, RoPE and MLP (two functions shared by all
    layers) around its eager attention, inside the same CUDA-graphed steps by lengths; one compile up front. Changes
    speed, not the data (up to bf16 rounding); faster on CUDA (BENCHMARKS.md#regeneration-in-the-gpu-presets-prepare-fused-layers--2026-12-04-1657-1700-utc), where the gpu
    recipe turns it on."""
    regen_dtype: str | None = None
    """Weights dtype of local regeneration: fp32, bf16 or fp16 (None: the target's). bf16 is faster on
    CPUs with AVX512-BF16/AMX; the replies are then the bf16 target's, which is still the target's style."""
    device: str = "cpu"
    """Device of local generation: cpu or cuda (the target loads there; on cuda in bf16 unless --regen-dtype)."""
    seed: int = 0
    """Seed for sampled regeneration."""

    def __post_init__(self):
        if self.regen_temperature < 0:
            raise EyasError(f"--regen-temperature must be >= 0, got {self.regen_temperature}")
        if self.samples_per_prompt < 1:
            raise EyasError(f"--samples-per-prompt must be >= 1, got {self.samples_per_prompt}")
        if self.samples_per_prompt > 1 and self.regen_temperature == 0:
            raise EyasError(f"--samples-per-prompt {self.samples_per_prompt} needs --regen-temperature > 0 "
                            "(greedy samples would all be the same)")
        if self.greedy_sample and self.samples_per_prompt < 2:
            raise EyasError(f"--greedy-sample needs --samples-per-prompt >= 2 (one greedy reply set and a sampled "
                            f"one), got {self.samples_per_prompt}")
        if self.self_prompts < 0:
            raise EyasError(f"--self-prompts must be >= 0, got {self.self_prompts}")
        if self.self_prompts and self.server:
            raise EyasError("--self-prompts needs local generation (it continues raw template text), not --server")
        if self.self_prompt_temperature <= 0:
            raise EyasError(f"--self-prompt-temperature must be > 0, got {self.self_prompt_temperature}")
        if self.max_new_tokens < 1 or self.concurrency < 1 or self.retries < 0:
            raise EyasError("--max-new-tokens and --concurrency must be >= 1, --retries >= 0")
        if self.gen_batch is not None and self.gen_batch < 1:
            raise EyasError(f"--gen-batch must be >= 1, got {self.gen_batch}")
        if self.regen_fuse and self.regen_compile:
            raise EyasError("--regen-fuse compiles the layers' pieces of eager steps, --regen-compile the whole step: "
                            "use one or the other")
        if self.regen_dtype not in (None, "fp32", "bf16", "fp16"):
            raise EyasError(f"--regen-dtype {self.regen_dtype!r}: expected fp32, bf16 or fp16")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise EyasError(f"--device {self.device!r}: expected cpu or cuda")
        if self.timeout <= 0:
            raise EyasError(f"--timeout must be > 0, got {self.timeout}")
        if self.regenerate_limit is not None and self.regenerate_limit < 0:
            raise EyasError(f"--regenerate-limit must be >= 0, got {self.regenerate_limit}")


@dataclass
class RegenStats:
    turns: int = 0              # replies generated
    cut: int = 0                # replies that hit max_new_tokens
    budget_cut: int = 0         # replies cut where the conversation reached max_len (it ends there)
    empty: int = 0              # replies that were empty (never trained on: the conversation is cut before them)
    new_tokens: int = 0         # tokens generated (replies and self-prompts)
    seconds: float = 0.0
    self_prompts: int = 0       # user turns written by the target (Magpie-style)
    self_prompts_cut: int = 0   # of those, cut at max_new_tokens / max_len before their end of turn

    def as_dict(self) -> dict:
        d = {"regenerated_turns": self.turns, "replies_cut_at_max_new_tokens": self.cut,
             "replies_cut_at_max_len": self.budget_cut, "empty_replies": self.empty,
             "generated_tokens": self.new_tokens,
             "generation_tokens_per_s": round(self.new_tokens / self.seconds, 1) if self.seconds else None}
        if self.self_prompts:
            d.update(self_prompts_written=self.self_prompts, self_prompts_cut=self.self_prompts_cut)
        return d


def _seed(base: int, conv_id: str, turn: int) -> int:
    h = hashlib.sha256(f"{base}:{conv_id}:{turn}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(h[:4], "big")


def is_empty_reply(text: str, specials=()) -> bool:
    """True when a reply holds nothing but whitespace and special-token text (e.g. a server that returns
    "<|im_end|>" unskipped): training on it would teach an empty reply."""
    for s in specials:
        text = text.replace(s, "")
    return not text.strip()


def cut_at_special(text: str, specials=()) -> str:
    """A server reply up to its first special-token text: an unskipped end-of-turn ("Hello<|im_end|>"), or a
    server that ran on into the next turn. Local regeneration stops at eos and decodes with
    skip_special_tokens; kept whole, the chat template would add a second end-of-turn after the first."""
    cut = min((i for i in (text.find(s) for s in specials if s) if i >= 0), default=len(text))
    return text[:cut]


def _assistant_turns(c: Conversation) -> list[int]:
    return [i for i, m in enumerate(c.messages) if m["role"] == "assistant"]


def _finish(c: Conversation, msgs: list[dict], reason: str | None, notes: list,
            detail: str | None = None) -> Conversation | Skipped:
    """Keep the conversation up to its last regenerated reply; skip it when none is left."""
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
    if last < 0:
        why = f"{reason}: {detail}" if detail else reason
        return Skipped(reason or "regeneration failed", c.where, f"{c.id}: no reply could be regenerated ({why})")
    if reason == "empty regenerated reply":
        notes.append(Skipped("cut at an empty regenerated reply", c.where,
                             f"{c.id}: kept the {sum(m['role'] == 'assistant' for m in msgs)} replies before it"))
    return replace(c, messages=tuple(msgs[: last + 1]))


# --------------------------------------------------------------------------- local

def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                eos_ids, seed: int, pad_id: int = 0) -> list[list[int]]:
    """Batched HF generation, same contract as Runner.generate: new tokens up to and including eos."""
    import torch

    dev = next(model.parameters()).device
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long, device=dev)
    att = torch.zeros_like(ids)
    for b, p in enumerate(prompts):  # left padding
        ids[b, T - len(p):] = torch.tensor(p, device=dev)
        att[b, T - len(p):] = 1
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos_ids) or None, pad_token_id=pad_id, **kw)
    res, eos = [], set(eos_ids)
    for row in out[:, T:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        res.append(row[:cut])
    return res


class LocalBackend:
    """Regenerate with the loaded target: all conversations of a call in lock-step by turn.

    Turn r of every conversation is one generation call: the runner sorts its prompts by length
    (longest first) and runs them `gen_batch` rows per forward, so rows of similar length share a
    forward. A reply is capped at max_new_tokens and at the room left before max_len (the token
    budget of the whole conversation); a reply cut by the budget ends its conversation.
    """

    def __init__(self, target, *, max_len: int, max_new_tokens: int, temperature: float, seed: int,
                 batch_size: int = 16, use_runner: bool = True, dtype: str | None = None,
                 gen_batch: int | None = None, compile: bool = False, fuse: bool = False):
        self.tok, self.model = target.tokenizer, target.model
        self.eos = list(target.eos_token_ids) if hasattr(target, "eos_token_ids") else [self.tok.eos_token_id]
        self.max_len, self.max_new, self.temperature, self.seed = max_len, max_new_tokens, temperature, seed
        self.stats = RegenStats()
        self.notes: list[Skipped] = []  # conversations kept but cut short, for prepare's skip log
        import torch

        self.dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self._generate = self._pick(gen_batch or batch_size, use_runner, compile, fuse)

    def _pick(self, batch_size: int, use_runner: bool, compile: bool = False, fuse: bool = False):
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else (self.eos[0] if self.eos else 0)
        if use_runner:
            try:
                runner = Runner.from_hf(self.model, max_batch=batch_size, max_seq=self.max_len + self.max_new,
                                        dtype=self.dtype, compile=compile, dynamic=True, fuse=fuse)
                self.runner = runner
                return lambda prompts, seed, temperature: runner.generate(
                    prompts, self.max_new, temperature=temperature, eos_ids=self.eos, seed=seed)
            except (ImportError, EyasError, AttributeError):
                pass

        def hf(prompts, seed, temperature):  # like Runner.generate: longest first, batch_size rows per call
            order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
            out: list[list[int]] = [[] for _ in prompts]
            for c in range(0, len(order), batch_size):
                idx = order[c:c + batch_size]
                rows = hf_generate(self.model, [prompts[i] for i in idx], self.max_new, temperature, self.eos,
                                   seed + c, pad)
                for i, row in zip(idx, rows):
                    out[i] = row
            return out
        return hf

    def generate(self, prompts: list[list[int]], seed: int, temperature: float | None = None) -> list[list[int]]:
        """New tokens of each prompt (up to and including eos, at most max_new_tokens)."""
        t0 = time.perf_counter()
        outs = self._generate(prompts, seed, self.temperature if temperature is None else temperature)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.new_tokens += sum(len(o) for o in outs)
        return outs

    def regenerate(self, convs: list[Conversation], progress=None,
                   temperature: float | None = None) -> list[Conversation | Skipped]:
        msgs = [list(c.messages) for c in convs]
        turns = [_assistant_turns(c) for c in convs]
        stop: list[str | None] = [None] * len(convs)  # why a conversation ended before its last turn
        for r in range(max((len(t) for t in turns), default=0)):
            batch, where = [], []
            live = [k for k in range(len(convs)) if not stop[k] and r < len(turns[k])]
            prompts = encode_prompts(self.tok, [msgs[k][:turns[k][r]] for k in live])  # one tokenizer call
            for k, prompt in zip(live, prompts):
                i = turns[k][r]
                if isinstance(prompt, TemplateError):
                    stop[k], msgs[k] = "chat template error", msgs[k][:i]
                    continue
                if len(prompt) >= self.max_len:  # the reply would be truncated away anyway
                    stop[k], msgs[k] = "prompt longer than max-len", msgs[k][:i]
                    continue
                batch.append(prompt)
                where.append((k, i, self.max_len - len(prompt)))
            if not batch:
                continue
            outs = self.generate(batch, _seed(self.seed, convs[where[0][0]].id, r), temperature)
            for (k, i, room), out in zip(where, outs):
                self.stats.turns += 1
                out = out[:room]
                if not out or out[-1] not in self.eos:  # no end of turn: cut by the budget or max_new_tokens
                    if len(out) == room:
                        self.stats.budget_cut += 1
                        stop[k] = "reached max-len"
                    else:
                        self.stats.cut += 1
                text = self.tok.decode(out, skip_special_tokens=True)
                if not text.strip():
                    self.stats.empty += 1
                    stop[k], msgs[k] = "empty regenerated reply", msgs[k][:i]
                    continue
                msgs[k][i] = {"role": "assistant", "content": text}
                if stop[k]:
                    msgs[k] = msgs[k][: i + 1]
            if progress is not None:
                progress(sum(len(o) for o in outs), self.stats)
        return [_finish(c, m, d, self.notes) for c, m, d in zip(convs, msgs, stop)]

    def self_prompts(self, start: int, n: int, temperature: float) -> list[Conversation | Skipped]:
        """Magpie: n user turns `magpie-<start>` ... sampled by the target from the template's user header
        alone, each with an empty assistant turn for `regenerate` to fill."""
        header = user_header(self.tok)
        room = self.max_len - len(header)
        outs = self.generate([header] * n, _seed(self.seed, "magpie", start), temperature)
        res: list[Conversation | Skipped] = []
        for j, out in enumerate(outs):
            cid, where = f"magpie-{start + j}", f"self-prompt {start + j}"
            out = out[:room]
            self.stats.self_prompts += 1
            if not out or out[-1] not in self.eos:
                self.stats.self_prompts_cut += 1
            text = self.tok.decode(out, skip_special_tokens=True).strip()
            if not text:
                res.append(Skipped("empty self-prompt", where, f"{cid}: the target wrote an empty user turn"))
                continue
            res.append(Conversation(cid, ({"role": "user", "content": text}, {"role": "assistant", "content": ""}),
                                    where, cid))
        return res


# --------------------------------------------------------------------------- server

def chat_url(server: str) -> str:
    url = server.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class ServerBackend:
    """Regenerate through an OpenAI-compatible chat-completions endpoint."""

    RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}

    def __init__(self, server: str, *, model: str | None, max_new_tokens: int, temperature: float, seed: int,
                 concurrency: int = 8, timeout: float = 120.0, retries: int = 3, backoff: float = 1.0,
                 max_backoff: float = 30.0, client=None, specials=()):
        self.url, self.max_new, self.temperature, self.seed = chat_url(server), max_new_tokens, temperature, seed
        self.concurrency, self.retries, self.backoff, self.max_backoff = concurrency, retries, backoff, max_backoff
        # the OpenAI API's base (.../v1): chat completions and the model list under it; `client`: an httpx.Client
        self.http = Client(self.url.rsplit("/chat/completions", 1)[0], timeout=timeout,
                           connect_timeout=min(timeout, 10.0), max_connections=concurrency, http=client)
        self.model = model or self._first_model()
        self.stats = RegenStats()
        self.notes: list[Skipped] = []
        self._lock = threading.Lock()
        self.sleeps: list[float] = []  # backoff delays taken (for the report and tests)
        self.specials = tuple(specials)  # the target's special-token texts: a reply of only these is empty

    def _first_model(self) -> str:
        try:
            return self.http.call("GET", "/models")["data"][0]["id"]
        except ServerError as e:
            why = e.reason
        except (KeyError, IndexError, TypeError) as e:
            why = str(e)
        raise EyasError(f"{self.http.where('/models')}: could not list the server's models ({why}); pass --model NAME")

    def _slept(self, delay: float) -> None:
        with self._lock:
            self.sleeps.append(delay)

    def _post(self, payload: dict, what: str) -> dict:
        """One chat completion, retried (serving.retrying) on a transport failure, a RETRY_STATUS or an answer
        that is not a chat completion; raises EyasError naming `what` when the retries run out, _Rejected for
        another HTTP error status."""
        def attempt(_k: int) -> dict:
            try:
                r = self.http.send("POST", "/chat/completions", payload)
            except ServerError as e:
                raise _Retry("timed out" if e.kind == TIMEOUT else
                             f"connection failed ({type(e.cause).__name__}: {e.cause})") from None
            if r.status_code in self.RETRY_STATUS:
                raise _Retry(f"HTTP {r.status_code} {r.text[:200]!r}")
            if r.status_code >= 400:
                raise _Rejected(r.status_code, r.text[:200])
            try:
                body = r.json()
                choice = body["choices"][0]
                text = choice["message"]["content"] or ""
                tokens = (body.get("usage") or {}).get("completion_tokens", 0) or 0
                if not isinstance(text, str):
                    raise TypeError(f"message content is {type(text).__name__}, not text")
                if not isinstance(tokens, int) or isinstance(tokens, bool):
                    raise TypeError(f"usage.completion_tokens is {type(tokens).__name__}, not an integer")
                return {"text": text, "finish": choice.get("finish_reason"), "tokens": tokens}
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                raise _Retry(f"unexpected response ({e})") from None

        try:
            return retrying(attempt, retries=self.retries, backoff=self.backoff, max_backoff=self.max_backoff,
                            retry_on=_Retry, slept=self._slept)
        except _Retry as e:
            raise EyasError(f"{self.url}: {what}: {e} after {self.retries + 1} attempts") from None

    def _one(self, c: Conversation, temperature: float) -> Conversation | Skipped:
        msgs = list(c.messages)
        for r, i in enumerate(_assistant_turns(c)):
            payload = {"model": self.model, "messages": msgs[:i], "max_tokens": self.max_new,
                       "temperature": temperature, "seed": _seed(self.seed, c.id, r)}
            try:
                out = self._post(payload, f"conversation {c.id} turn {i}")
            except _Rejected as e:  # counted by status (the server's text, e.g. a prompt's length, varies per request)
                with self._lock:
                    return _finish(c, msgs[:i], f"server rejected: HTTP {e.status}", self.notes, detail=e.text)
            text = cut_at_special(out["text"], self.specials)
            empty = is_empty_reply(text, self.specials)
            with self._lock:
                self.stats.turns += 1
                self.stats.new_tokens += out["tokens"]
                self.stats.cut += out["finish"] == "length"
                self.stats.empty += empty
                if empty:
                    return _finish(c, msgs[:i], "empty regenerated reply", self.notes)
            msgs[i] = {"role": "assistant", "content": text}
        return replace(c, messages=tuple(msgs))

    def regenerate(self, convs: list[Conversation], progress=None,
                   temperature: float | None = None) -> list[Conversation | Skipped]:
        temperature = self.temperature if temperature is None else temperature
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = [pool.submit(self._one, c, temperature) for c in convs]
            try:
                out = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        self.stats.seconds += time.perf_counter() - t0
        if progress is not None:
            progress(0, self.stats)
        return out


class _Retry(Exception):
    """A failed attempt that the next one may fix; its text says what went wrong."""


class _Rejected(Exception):
    """A 4xx answer that retrying will not fix (e.g. the prompt is too long for the server)."""

    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status} {text!r}")
        self.status, self.text = status, text


def make_backend(cfg, target):
    """The backend of a PrepareConfig `cfg`: a server's when cfg.regen.server is set, else the loaded target's."""
    r = cfg.regen
    if r.server:
        return ServerBackend(r.server, model=r.model, max_new_tokens=r.max_new_tokens,
                             temperature=r.regen_temperature, seed=r.seed, concurrency=r.concurrency,
                             timeout=r.timeout, retries=r.retries,
                             specials=special_strings(target.tokenizer) if target is not None else ())
    return LocalBackend(target, max_len=cfg.max_len, max_new_tokens=r.max_new_tokens,
                        temperature=r.regen_temperature, seed=r.seed, batch_size=cfg.batch_size,
                        dtype=r.regen_dtype, gen_batch=r.gen_batch, compile=r.regen_compile,
                        fuse=r.regen_fuse)
