"""`eyas bench --engine sglang|vllm`: a served drafter's tau and speedup, measured in the engine from its counters.

The bench for a target only an engine can run. Prompts, turns and cuts are the in-process bench's
(load_bench_prompts, prompt_room, the chat template applied here and the ids sent as ids, every turn answered
with the server's own earlier replies as context), greedy, stopping at the target's eos ids as eyas does. The
speculative server (--url) and the plain server (--plain-url: the same target without a drafter) answer every
turn in turn; tok/s is each one's output tokens over its time in requests, the speedup their ratio. tau is
eyas's unit, tokens per target forward with the prefill counted, so plain decoding is 1:
- SGLang: completion tokens / (meta_info.spec_verify_ct + 1) per reply; acceptance by position from
  meta_info.spec_correct_drafts_histogram (verify steps by drafts accepted) where the server sends it;
- vLLM: tokens / (the rise of vllm:spec_decode_num_drafts + 1 per reply), from /metrics before and after;
  acceptance by position from vllm:spec_decode_num_accepted_tokens_per_pos. The counters are the server's:
  other traffic while the bench runs is counted too.
The two servers' greedy replies are compared turn by turn (`agreement`): the engine's own losslessness check, in
its dtype, where a near-tie may flip a token (check.py). Where they differ, the plain server's log-probabilities of
its own token and the drafted one at the first differing position say whether it was such a near-tie
(`divergences`). Any failure stops the bench with one line saying how
many replies had finished; no partial report is written.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from eyas.bench.bench import BenchConfig, Method, prompt_room
from eyas.bench.check import agreement, common_prefix
from eyas.bench.output import write_report
from eyas.bench.prompts import load_bench_prompts, prompt_ids, prompt_summary, tau_by_kind
from eyas.errors import EyasError
from eyas.serving import Client, ENGINES, SERVER_INFO, greedy_request, reply_ids
from eyas.target.fingerprint import text_config
from eyas.target.load import eos_ids

DRAFTS = "vllm:spec_decode_num_drafts"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
TOP_K = 5   # candidates asked for at a differing position
MODEL_INFO = ("/get_model_info", "/model_info")   # where SGLang reports its model path, under either name


@dataclass(frozen=True, kw_only=True)
class EngineBenchConfig:
    """Where the served target is; the prompts and turn rules are the BenchConfig's."""

    engine: str
    """sglang | vllm: the engine serving --url and --plain-url."""
    url: str
    """The speculative server's base URL (the target served with the drafter), e.g. http://127.0.0.1:30000."""
    plain_url: str | None = None
    """The same target served without a drafter: the speedup's baseline and the greedy agreement (None: tau only)."""
    model: str | None = None
    """The served model name, checked against each server's /v1/models (None: the one each server serves)."""
    request_timeout: float = 600.0
    """Seconds one request may take."""
    concurrency: int = 1
    """Records in flight on a server (a record's turns go one after another)."""
    trust_remote_code: bool = False
    """Load --target's tokenizer with its own code (remote-code tokenizers, e.g. Kimi's)."""
    drafter_kind: str | None = None
    """The served drafter's family, eagle3 or dflash: it names the report's method. vLLM's server does not say which
    it serves (None there: eagle3); SGLang's does, and a different value is refused."""

    def __post_init__(self):
        if self.drafter_kind not in (None, "eagle3", "dflash"):
            raise EyasError(f"--drafter-kind {self.drafter_kind!r}: expected eagle3 or dflash")
        if self.engine not in ENGINES:
            raise EyasError(f"engine {self.engine!r}: expected sglang or vllm")
        if not self.url:
            raise EyasError("--engine needs --url, the speculative server's base URL")
        if self.request_timeout <= 0 or self.concurrency < 1:
            raise EyasError("--request-timeout must be > 0 and --concurrency >= 1")


def open_tokenizer(target: str, *, trust_remote_code: bool = False):
    """(tokenizer, eos ids) of the served target from a local directory: config and tokenizer are enough, no
    weights (target/meta.py's open_target_meta would also want the head shards). The eos ids follow the in-process
    rule (target/load.py eos_ids) over config and generation config, a nested text_config's too."""
    d = Path(target)
    if not d.is_dir():
        raise EyasError(f"--target {target}: bench --engine needs the served model's directory (its config and "
                        f"tokenizer; no weights)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any loader failure is one line
        hint = "" if trust_remote_code else "; a tokenizer with its own code needs --trust-remote-code"
        raise EyasError(f"{d}: cannot load its tokenizer ({type(e).__name__}: {str(e).splitlines()[0][:200]}){hint}")

    declared = []
    for name in ("config.json", "generation_config.json"):
        if (d / name).is_file():
            c = json.loads((d / name).read_text())
            declared += [src.get("eos_token_id") for src in (c, text_config(c))]   # the wrapper's and its LM's
    return tok, eos_ids(declared, tok)


class EngineServer:
    """One engine server: what it serves, greedy requests of token ids, and its speculative counters. Requests go
    through one serving.Client; errors name `flag` (--url or --plain-url), the URL and the request."""

    def __init__(self, engine: str, url: str, timeout: float, flag: str):
        self.http = Client(url, timeout=timeout, flag=flag, timeout_flag="--request-timeout")
        self.engine, self.url, self.timeout, self.flag = engine, self.http.url, timeout, flag
        self.model: str | None = None  # the served name vLLM requests carry

    def describe(self, model: str | None) -> dict:
        """Served name (checked against `model`), model path, engine version, dtype and speculative settings
        (None: the server does not decode speculatively)."""
        cards = [c for c in (self.http.call("GET", "/v1/models").get("data") or []) if c.get("id")]
        served = [c["id"] for c in cards]
        if not served or (model is not None and model not in served):
            raise EyasError(f"{self.flag} {self.url} serves {', '.join(map(repr, served)) or 'no model'}"
                            + (f", not {model!r} (--model)" if model is not None else ""))
        self.model = model or served[0]
        info = {"url": self.url, "served_model": self.model}
        if self.engine == "sglang":
            s = self.http.first(SERVER_INFO["sglang"])
            m = self.http.first(MODEL_INFO)
            algo = s.get("speculative_algorithm")
            spec = None if not algo else {
                "algorithm": algo, "num_steps": s.get("speculative_num_steps"),
                "eagle_topk": s.get("speculative_eagle_topk"), "num_draft_tokens": s.get("speculative_num_draft_tokens"),
                "draft_model": s.get("speculative_draft_model_path")}
            info.update(model_path=m.get("model_path") or s.get("model_path"), version=s.get("version"),
                        dtype=s.get("dtype"), speculative=spec)
        else:
            card = next(c for c in cards if c["id"] == self.model)
            version = (self.http.call("GET", "/version", missing_ok=True) or {}).get("version")
            metrics = self.http.call("GET", "/metrics", text=True)
            spec = {"algorithm": "vllm speculative config"} if DRAFTS in metrics else None
            info.update(model_path=card.get("root") or self.model, version=version, dtype=None, speculative=spec)
        return info

    def generate(self, ids: list[int], n: int, eos: list[int]) -> tuple[list[int], int | None, list[int] | None]:
        """Greedy reply to prompt `ids` -> (its token ids, SGLang's verify steps or None, SGLang's histogram of
        verify steps by drafts accepted or None)."""
        path, body = greedy_request(self.engine, ids, n, model=self.model, stop=eos, token_ids=True)
        r = self.http.call("POST", path, body)
        out = reply_ids(self.engine, r)
        if self.engine == "sglang":
            if not isinstance(out, list):
                raise EyasError(f"{self.flag} {self.url}/generate: the reply has no output_ids")
            m = r.get("meta_info") or {}
            # spec_accept_histogram: the field's earlier name, kept as an alias in 0.5.14
            hist = m.get("spec_correct_drafts_histogram") or m.get("spec_accept_histogram")
            return out, m.get("spec_verify_ct"), hist
        if not isinstance(out, list):
            raise EyasError(f"{self.flag} {self.url}/v1/completions: the reply has no token_ids (this vLLM does not "
                            f"take return_token_ids)")
        return out, None, None

    def top_logprobs(self, ids: list[int], k: int) -> dict[int, float]:
        """The server's log-probabilities of its k likeliest next tokens after prompt `ids` -> {token id: logprob}."""
        path, body = greedy_request(self.engine, ids, 1, model=self.model, top_logprobs=k)
        r = self.http.call("POST", path, body)
        if self.engine == "sglang":
            tops = ((r.get("meta_info") or {}).get("output_top_logprobs") or [None])[0]
            pairs = [(t[1], t[0]) for t in tops or ()]            # (logprob, token id, text) per candidate
        else:
            tops = ((((r.get("choices") or [{}])[0]).get("logprobs") or {}).get("top_logprobs") or [None])[0]
            pairs = [(key.rsplit(":", 1)[-1], v) for key, v in (tops or {}).items()]   # "token_id:ID": logprob
        try:
            out = {int(t): float(v) for t, v in pairs}
        except (TypeError, ValueError):
            out = {}
        if not out:
            raise EyasError(f"{self.flag} {self.url}: the reply has no top log-probabilities for the next token")
        return out

    def counters(self) -> tuple[float, list[float]]:
        """vLLM's (drafts, accepted drafts by position) now, summed over its engines' label sets."""
        drafts, pos = 0.0, {}
        for line in self.http.call("GET", "/metrics", text=True).splitlines():
            if line.startswith("#") or " " not in line:
                continue
            head, value = line.rsplit(" ", 1)
            name = head.split("{", 1)[0].removesuffix("_total")
            if name == DRAFTS:
                drafts += float(value)
            elif name == PER_POS and 'position="' in head:
                j = int(head.split('position="', 1)[1].split('"', 1)[0])
                pos[j] = pos.get(j, 0.0) + float(value)
        return drafts, [pos.get(j, 0.0) for j in range(max(pos) + 1)] if pos else []

    def settled_counters(self, wait_s: float = 2.0, poll_s: float = 0.1):
        """counters() once two reads in a row agree (a reply may be sent before its step is counted)."""
        last, deadline = self.counters(), time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            now = self.counters()
            if now == last:
                break
            last = now
        return last


def _turn_prompt(rec, tok, room, replies: list[list[int]]) -> tuple[list[int], bool]:
    """The prompt of turn len(replies) of `rec`: its fixed context, then each earlier turn with the reply the
    server gave (decoded as text, as a chat client would send it back)."""
    msgs = [dict(c) for c in rec.get("context", ())]
    for turn, out in zip(rec["turns"], replies):
        msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)}]
    msgs.append({"role": "user", "content": rec["turns"][len(replies)]})
    return prompt_ids(tok, msgs, room)


def _answer(server, rec, tok, room, n, eos, spec, stop, on_reply=lambda: None) -> list[tuple]:
    """Every turn of one record, each with the server's own earlier replies as context -> per turn (reply ids,
    verify steps, histogram, truncated, seconds in the request); on_reply() after each reply."""
    turns = []
    for _ in rec["turns"]:
        if stop.is_set():
            break
        ids, cut = _turn_prompt(rec, tok, room, [t[0] for t in turns])
        t0 = time.perf_counter()
        out, verifies, hist = server.generate(ids, n, eos)
        dt = time.perf_counter() - t0
        if spec and server.engine == "sglang" and verifies is None and len(out) > 1:
            raise EyasError(f"{server.flag} {server.url} does not decode speculatively: a {len(out)}-token reply has "
                            f"no meta_info.spec_verify_ct (serve the target with its drafter there)")
        turns.append((out, verifies or 0, hist, cut, dt))
        on_reply()
    return turns


@dataclass(frozen=True)
class Requests:
    """What every server is asked: each record's turns (encoded with `tok`, left-truncated to `room` tokens), each
    answered greedily with up to `max_new_tokens` tokens, stopping at the `eos` ids."""

    records: list[dict]
    tok: object
    room: int
    max_new_tokens: int
    eos: list[int]


def divergences(plain: EngineServer, req: Requests, spec_out, plain_out, k: int = TOP_K) -> list[dict]:
    """Where the speculative server's greedy reply first leaves the plain server's, in each record's first turn that
    differs (later turns start from different contexts): the plain server's log-probabilities of its own token
    and of the drafted one after the common prefix. A margin near zero is a near-tie that the two servers' kernels
    (batch shapes, verify vs decode) may round either way; a large one, or a drafted token outside the plain
    server's top k, is a lossless-decoding bug. margin None: one reply ended there, or the drafted token is not
    in the top k."""
    found = []
    for ri, (rec, a_turns, b_turns) in enumerate(zip(req.records, plain_out, spec_out, strict=True)):
        t = next((j for j, (a, b) in enumerate(zip(a_turns, b_turns)) if a != b), None)
        if t is None:
            continue
        a, b = a_turns[t], b_turns[t]
        p = common_prefix(a, b)
        row = {"record": ri, "turn": t, "position": p, "plain": a[p] if p < len(a) else None,
               "spec": b[p] if p < len(b) else None, "margin": None}
        if row["plain"] is not None and row["spec"] is not None:
            ids = _turn_prompt(rec, req.tok, req.room, a_turns[:t])[0] + a[:p]
            lp = plain.top_logprobs(ids, k)
            row["plain_logprob"] = lp.get(row["plain"])
            row["spec_logprob"] = lp.get(row["spec"])
            if row["plain_logprob"] is not None and row["spec_logprob"] is not None:
                row["margin"] = round(row["plain_logprob"] - row["spec_logprob"], 4)
        found.append(row)
    return found


def _replies(server: EngineServer, req: Requests, *, spec: bool, concurrency: int, counters: bool,
             per_record: bool) -> tuple[list[list[tuple]], list, float]:
    """Every record on one server, `concurrency` records in flight -> (_answer's turns of each record, in record
    order; vLLM's counters (drafts, by position) with `counters`: before and after the phase, and with `per_record`
    after each record as well; the phase's wall seconds). Stops at the first failure with one line saying how many
    replies had finished."""
    total = sum(len(r["turns"]) for r in req.records)
    results: dict[int, list] = {}
    marks = []
    stop, lock, done = threading.Event(), threading.Lock(), [0]

    def replied():
        with lock:
            done[0] += 1

    def one(ri):
        turns = _answer(server, req.records[ri], req.tok, req.room, req.max_new_tokens, req.eos, spec, stop, replied)
        if per_record:
            marks.append(server.counters())
        return ri, turns

    if counters:
        marks.append(server.settled_counters())
    t0 = time.perf_counter()
    try:
        if concurrency == 1:
            for ri in range(len(req.records)):
                results.update([one(ri)])
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                futs = [pool.submit(one, ri) for ri in range(len(req.records))]
                try:
                    for f in as_completed(futs):
                        results.update([f.result()])
                except BaseException:
                    stop.set()
                    for f in futs:
                        f.cancel()
                    raise
    except EyasError as e:
        raise EyasError(f"{e}; {done[0]} of {total} replies had finished, no report written") from None
    wall = time.perf_counter() - t0
    if counters:
        end = server.settled_counters()
        marks = marks[:-1] + [end] if per_record else [marks[0], end]
    return [results[ri] for ri in range(len(req.records))], marks, wall


def _serve_all(server: EngineServer, name: str, req: Requests, *, spec: bool, depth: int = 0,
               concurrency: int = 1) -> tuple[Method, int]:
    """All records on one server -> (the method's outputs, stats and seconds; prompts left-truncated).
    `depth`: draft positions the server proposes (acceptance is reported for each, reached or not). Target forwards
    are SGLang's verify steps per reply, or the rise of vLLM's draft counter (per record only at batch 1: the
    counters are the server's)."""
    vllm_spec = spec and server.engine == "vllm"
    per_record = vllm_spec and concurrency == 1
    results, marks, wall = _replies(server, req, spec=spec, concurrency=concurrency, counters=vllm_spec,
                                    per_record=per_record)
    m, truncated = Method(name, None), 0
    if spec:
        m.stats.accepted_at = [0] * depth
    for ri, turns in enumerate(results):
        tokens = sum(len(t[0]) for t in turns)
        m.outputs.append([t[0] for t in turns])
        truncated += sum(t[3] for t in turns)
        m.stats.tokens += tokens
        if not spec:
            m.stats.target_forwards += tokens
            m.per_record.append([tokens, tokens])
        elif server.engine == "sglang":
            forwards = sum(t[1] + 1 for t in turns)
            m.stats.target_forwards += forwards
            m.stats.rounds += sum(t[1] for t in turns)
            for hist in (t[2] for t in turns if t[2]):
                _add_positions(m.stats, [sum(hist[j:]) for j in range(1, len(hist))])
            m.per_record.append([tokens, forwards])
        elif per_record:
            m.per_record.append([tokens, round(marks[ri + 1][0] - marks[ri][0]) + len(turns)])
    if vllm_spec:
        _vllm_counts(m, server, marks, replies=sum(len(r["turns"]) for r in req.records))
    m.seconds = sum(t[4] for ts in results for t in ts) if concurrency == 1 else wall
    return m, truncated


def _vllm_counts(m: Method, server: EngineServer, marks: list, replies: int) -> None:
    """m's rounds, target forwards and acceptance by position from vLLM's counters before and after the phase."""
    drafts = round(marks[-1][0] - marks[0][0])
    if drafts == 0 and m.stats.tokens > replies:
        raise EyasError(f"{server.flag} {server.url} does not decode speculatively: {m.stats.tokens} tokens "
                        f"and no {DRAFTS} counted (serve the target with its drafter there)")
    m.stats.rounds, m.stats.target_forwards = drafts, drafts + replies
    before, after = marks[0][1], marks[-1][1]
    _add_positions(m.stats, [round(a - (before[j] if j < len(before) else 0)) for j, a in enumerate(after)])


def _add_positions(stats, counts: list[int]) -> None:
    """accepted_at[j] += counts[j]: verify steps whose accepted drafts reached position j."""
    stats.accepted_at += [0] * (len(counts) - len(stats.accepted_at))
    for j, c in enumerate(counts):
        stats.accepted_at[j] += c


def _open_servers(eng: EngineBenchConfig) -> tuple[tuple[EngineServer, dict], tuple[EngineServer, dict] | None]:
    """((the speculative server, what it serves), (the plain server, what it serves) or None without --plain-url),
    refusing a --url that does not decode speculatively, a --plain-url that does, and two different targets."""
    spec_srv = EngineServer(eng.engine, eng.url, eng.request_timeout, "--url")
    spec_info = spec_srv.describe(eng.model)
    if spec_info["speculative"] is None:
        raise EyasError(f"--url {eng.url} does not decode speculatively ("
                        + ("its server info has no speculative_algorithm" if eng.engine == "sglang"
                           else f"its /metrics has no {DRAFTS}") + "): serve the target with its drafter there")
    if not eng.plain_url:
        return (spec_srv, spec_info), None
    plain_srv = EngineServer(eng.engine, eng.plain_url, eng.request_timeout, "--plain-url")
    plain_info = plain_srv.describe(eng.model)
    if plain_info["speculative"] is not None:
        raise EyasError(f"--plain-url {eng.plain_url} decodes speculatively ({plain_info['speculative']['algorithm']}"
                        f"): the baseline is the target served without a drafter")
    a, b = (Path(str(i["model_path"]).rstrip("/")).name for i in (spec_info, plain_info))
    if a != b:
        raise EyasError(f"--url serves {spec_info['model_path']!r} but --plain-url serves "
                        f"{plain_info['model_path']!r}: the speedup needs one target on both")
    return (spec_srv, spec_info), (plain_srv, plain_info)


def run_engine_bench(cfg: BenchConfig, eng: EngineBenchConfig, *, tokenizer=None, eos_ids=None, out=None) -> dict:
    """Bench the servers of `eng` on cfg's prompts; return (and with cfg.json_out write) the report dict, in
    run_bench's format plus `engine` (engine, URLs, served model, versions, speculative settings)."""
    out = out or sys.stdout
    if cfg.spec.temperature != 0:
        raise EyasError("bench --engine decodes greedily: leave --temperature at 0")
    if cfg.drafter:
        raise EyasError("bench --engine measures the drafter the server at --url serves: drop --drafter")
    clock = t_start = time.perf_counter()
    if tokenizer is None:
        tokenizer, eos_ids = open_tokenizer(cfg.target, trust_remote_code=eng.trust_remote_code)
    skipped = {"too_long": 0, "too_short": 0}
    records, _ = load_bench_prompts(cfg, tokenizer, skipped)
    req = Requests(records, tokenizer, prompt_room(cfg), cfg.max_new_tokens, eos_ids)
    (spec_srv, spec_info), plain = _open_servers(eng)
    servers = ([plain] if plain else []) + [(spec_srv, spec_info)]   # plain first: run_bench's order
    seconds = {"load": time.perf_counter() - clock}

    clock = time.perf_counter()  # warm-up, not timed: the first prompt's first tokens on each server
    first = {**records[0], "turns": records[0]["turns"][:1]}
    for srv, _ in servers:
        try:
            _answer(srv, first, tokenizer, req.room, min(cfg.max_new_tokens, 16), eos_ids, srv is spec_srv,
                    threading.Event())
        except EyasError as e:
            raise EyasError(f"{e} (warm-up request)") from None
    seconds["warmup"] = time.perf_counter() - clock

    clock = time.perf_counter()
    spec_name = _spec_name(spec_info["speculative"], eng.engine, eng.drafter_kind)
    methods, truncated = [], 0
    for srv, _ in servers:
        m, cut = _serve_all(srv, spec_name if srv is spec_srv else "plain", req, spec=srv is spec_srv,
                            depth=_depth(spec_info["speculative"], spec_name), concurrency=eng.concurrency)
        truncated = truncated or cut  # counted on the first server, as run_bench counts on its first method
        methods.append(m)
    seconds["decode"] = time.perf_counter() - clock
    if truncated:
        print(f"warning: {truncated} prompt(s) longer than {req.room} tokens were left-truncated", file=out)

    dtype = " ".join(x for x in (eng.engine, spec_info.get("dtype")) if x and x != "auto")
    report = {"config": cfg.to_dict(), "target": {"dir": cfg.target, "model_path": spec_info["model_path"]},
              "drafter": spec_info["speculative"].get("draft_model"), "device": f"{eng.engine} {eng.url}",
              "dtype": dtype, "records": len(records), "turns": sum(len(r["turns"]) for r in records),
              "truncated": truncated, "skipped_long_prompts": skipped["too_long"],
              "skipped_short_prompts": skipped["too_short"], "prompts": prompt_summary(records, tokenizer),
              "methods": {m.name: m.report() for m in methods},
              "engine": {**asdict(eng), "spec": spec_info, "plain": plain[1] if plain else None,
                         "counters": "meta_info.spec_verify_ct per reply" if eng.engine == "sglang"
                         else f"{DRAFTS} and {PER_POS} of /metrics"}}
    tau_by_kind(report, records)
    if plain:
        seconds["divergences"] = _against_plain(report, spec_name, methods, plain[0], req, out)
    seconds["lossless_check"] = 0.0
    seconds["total"] = time.perf_counter() - t_start
    report["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    write_report(report, cfg.json_out, out)
    return report


def _against_plain(report: dict, spec_name: str, methods: list[Method], plain_srv: EngineServer, req: Requests,
                   out) -> float:
    """The speculative server against the plain one, into `report`: the speedup, the greedy agreement and the
    divergences (a warning instead where the plain server cannot give them). Returns the divergences' seconds."""
    plain, sp = methods
    if plain.seconds and sp.seconds:
        report["methods"][spec_name]["speedup"] = round((sp.stats.tokens / sp.seconds)
                                                        / (plain.stats.tokens / plain.seconds), 3)
    report["agreement"] = {spec_name: {"dtype": report["dtype"], **agreement(sp.outputs, plain.outputs)}}
    clock = time.perf_counter()
    try:
        div = divergences(plain_srv, req, sp.outputs, plain.outputs)
    except EyasError as e:   # the measurement stands without it: say why it is missing
        print(f"warning: no margins at the differing tokens: {e}", file=out)
        div = None
    report["agreement"][spec_name]["divergences"] = div
    return time.perf_counter() - clock


def _depth(spec: dict, name: str) -> int:
    """Draft positions a round proposes: SGLang's num_steps for EAGLE; a DFlash block's draft tokens less the
    committed one (SGLang forces DFlash's num_steps to 1)."""
    if name == "dflash":
        return max((spec.get("num_draft_tokens") or 1) - 1, 0)
    return spec.get("num_steps") or 0


def _spec_name(spec: dict, engine: str, kind: str | None = None) -> str:
    """The report's method name as run_bench names it: dflash for a DFlash drafter (SGLang's DFLASH algorithm, or
    `kind` on vLLM), else eagle-chain / eagle-tree (SGLang: a tree when its eagle_topk > 1; vLLM's EAGLE drafts a
    chain); another SGLang algorithm keeps its own name. A `kind` that contradicts SGLang's algorithm is refused."""
    algo = str(spec.get("algorithm", "")).lower()
    if engine == "vllm":
        return "dflash" if kind == "dflash" else "eagle-chain"
    served = "dflash" if algo == "dflash" else "eagle3" if algo.startswith("eagle") else None
    if kind and served != kind:
        raise EyasError(f"--drafter-kind {kind}, but the server at --url serves {spec.get('algorithm')!r}")
    if algo == "dflash":
        return "dflash"
    if algo.startswith("eagle"):
        return "eagle-tree" if (spec.get("eagle_topk") or 1) > 1 else "eagle-chain"
    return algo
