"""`eyas bench`: acceptance length and real speedup of a drafter, with baselines in the same run.

For each prompt (multi-turn records are answered turn by turn with each method's own previous
answers as context, like MT-bench) it decodes with: plain fast decoding (no drafter), prompt
lookup, and the drafter: EAGLE-3 (chain or tree) or DFlash (one block of B-1 drafts per round). tokens/s are measured in this run on the same
runner, so the speedup is against eyas's fastest plain decoder. At temperature 0 the speculative
outputs must equal the plain greedy outputs (the lossless check).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

import eyas.target  # load_target looked up at call time: tests patch it
from eyas.bench.check import (DTYPE_NAMES, agreement, exact_fp32, first_turns, fp32_drafter, fp32_runner,
                              lossless_verdict)
from eyas.bench.output import write_report
from eyas.bench.prompts import first_messages, load_bench_prompts, prompt_ids, prompt_summary, tau_by_kind
from eyas.bench.startup import compile_cache, saved_steps, tree_nodes, verify_shapes, warm_up
from eyas.data.longprompts import LONG_TOKENS, is_long_set
from eyas.decode.dflash import block_drafts, check_spec, is_dflash
from eyas.decode.spec import SpecConfig, SpecDecoder, SpecStats
from eyas.errors import EyasError
from eyas.manifest import check_same
from eyas.model.checkpoint import open_drafter  # shared with `eyas export`, `train --init` and `eyas run`
from eyas.target.fingerprint import cache_root
from eyas.target.runner import Runner

PROMPT_SETS = ("sharegpt-heldout", "humaneval", "long")


SPEC_KNOBS = tuple(f.name for f in fields(SpecConfig))
"""The decode knobs BenchConfig also takes flat (recipes' [[bench]] tables, `eyas bench`'s flags)."""


@dataclass(frozen=True, kw_only=True, init=False)
class BenchConfig:
    """One benchmark. The decode knobs live in `spec`; BenchConfig(method="tree", k=3, ...) also takes them flat,
    the form of recipes' [[bench]] tables and of `eyas bench`'s flags (see __init__)."""

    target: str = "smollm2-135m"
    """Target spec (embedded name, HF dir, GGUF)."""
    drafter: str | None = None
    """Drafter: eyas run dir (RUN/, e.g. runs/cpu-demo), train run dir, drafter dir, or exported/published EAGLE-3
    or DFlash dir (None: baselines only)."""
    prompts: str = "sharegpt-heldout"
    """sharegpt-heldout | humaneval | long (held-out chats kept whole, 2k-6k tokens) | a .jsonl with `prompt` or
    `turns` (and optionally `context`)."""
    spec: SpecConfig = SpecConfig()
    """The drafter's decoding: method chain | tree, its shape and sampling; prompt lookup takes k and max_ngram. A
    DFlash drafter runs chains of k = B-1 drafts unless k is given (at most B-1)."""
    max_new_tokens: int = 128
    """New tokens per turn."""
    limit: int | None = 20
    """Prompt records used (None = all)."""
    max_turns: int | None = None
    """Answer only the first N user turns of each record (None = all)."""
    max_prompt_tokens: int | None = None
    """Skip records whose first prompt (context + first turn, chat template applied) is longer, e.g. to match what
    a drafter was trained on; skipped records are counted in the report (None = keep all; 6144 for `long`)."""
    min_prompt_tokens: int | None = None
    """Skip records whose first prompt is shorter, counted like max_prompt_tokens (None = keep all; 2048 for
    `long`)."""
    max_seq: int | None = None
    """Target cache slots; longer prompts are left-truncated (counted). None: room for a max_prompt_tokens prompt,
    its reply and a draft, rounded up to 64, and at least 2048."""
    device: str = "cpu"
    """cpu | cuda."""
    dtype: str | None = None
    """fp32 | bf16 | fp16 (default: bf16 on CUDA, fp32 on the CPU); fp32 makes the lossless check exact."""
    compile: bool = False
    """torch.compile the target's graphed steps (CUDA)."""
    persist_steps: bool = False
    """With compile: keep the target's compiled steps in $EYAS_CACHE/steps, so later benches load them instead of
    tracing them again (torch.compile's ahead-of-time compile); what it saves on the H200:
    BENCHMARKS.md#the-bench-process-with-saved-steps---persist-steps-chain-5."""
    baselines: bool = True
    """Also run plain decoding and prompt lookup."""
    lossless_turns: int = 4
    """Greedy benches not in fp32: decode the first N turns again in fp32 as the exact lossless check (0 = off)."""
    seed: int = 0
    """Sampling seed."""
    json_out: str | None = None
    """Write the report here (and the plot next to it as .png)."""
    trust_remote_code: bool = False
    """Let the target's own code (a remote-code tokenizer or config) run when the bench opens it."""

    def __init__(self, *, spec: SpecConfig | None = None, **kw):
        """The fields by name; a decode knob given flat (one of SPEC_KNOBS) is set in `spec`, on top of `spec` when
        both are given (so `dataclasses.replace(cfg, k=3)` works too)."""
        flat = {k: kw.pop(k) for k in SPEC_KNOBS if k in kw}
        own = [f for f in fields(BenchConfig) if f.name != "spec"]
        if unknown := sorted(set(kw) - {f.name for f in own}):
            raise TypeError(f"BenchConfig got unexpected keyword arguments {unknown}")
        for f in own:
            object.__setattr__(self, f.name, kw.get(f.name, f.default))
        object.__setattr__(self, "spec", replace(spec or SpecConfig(), **flat))
        # whether k was chosen (flat, or a spec whose k is not the default), not a field: a DFlash drafter's default
        # chain is its whole block (`for_drafter`)
        object.__setattr__(self, "_k_given", "k" in flat or (spec is not None and spec.k != SpecConfig.k))
        if is_long_set(self.prompts):  # the set's own length range, unless given
            lo, hi = LONG_TOKENS
            object.__setattr__(self, "min_prompt_tokens", lo if self.min_prompt_tokens is None else self.min_prompt_tokens)
            object.__setattr__(self, "max_prompt_tokens", hi if self.max_prompt_tokens is None else self.max_prompt_tokens)
        if self.max_seq is None:
            need = (self.max_prompt_tokens or 0) + self.max_new_tokens + max(self.spec.draft_size, self.spec.k) + 2
            object.__setattr__(self, "max_seq", max(2048, -(-need // 64) * 64))
        self.__post_init__()

    def __post_init__(self):
        if self.spec.method not in ("chain", "tree"):
            raise EyasError(f"bench method {self.spec.method!r}: expected chain or tree")
        if self.max_new_tokens < 1:
            raise EyasError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.dtype not in (None, "fp32", "bf16", "fp16"):
            raise EyasError(f"dtype {self.dtype!r}: expected fp32, bf16 or fp16")
        if self.limit is not None and self.limit < 1:
            raise EyasError(f"limit must be >= 1, got {self.limit}")
        if self.max_turns is not None and self.max_turns < 1:
            raise EyasError(f"max_turns must be >= 1, got {self.max_turns}")
        lo, hi = self.min_prompt_tokens, self.max_prompt_tokens
        if (lo is not None and lo < 1) or (hi is not None and hi < 1) or (None not in (lo, hi) and lo > hi):
            raise EyasError(f"prompt token range [{lo}, {hi}]: expected 1 <= min_prompt_tokens <= max_prompt_tokens")
        if self.lossless_turns < 0:
            raise EyasError(f"lossless_turns must be >= 0, got {self.lossless_turns}")
        if self.persist_steps and not self.compile:
            raise EyasError("persist_steps keeps compiled steps: it needs compile")

    @property
    def lookup(self) -> SpecConfig:
        """The prompt-lookup baseline's decoding: the drafter's k, max_ngram and sampling."""
        return replace(self.spec, method="lookup", graph_round=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchConfig":
        """A config as to_dict writes it ({"spec": {...}, ...})."""
        d = dict(d)
        spec = d.pop("spec", None)
        if not isinstance(spec, dict):
            raise EyasError("bench config: no `spec` table of decode knobs (written by an older eyas: run the bench "
                            "again)")
        unknown = sorted(set(d) - {f.name for f in fields(cls)}) + sorted(set(spec) - set(SPEC_KNOBS))
        if unknown:
            raise EyasError(f"bench config: unknown keys {unknown}")
        return cls(spec=SpecConfig(**spec), **d)


def graph_round_default(device: str, temperature: float) -> bool:
    """Whether a bench that does not say runs each round as one CUDA graph (spec.graph_round): greedy chains and
    trees on CUDA, where one-graph rounds beat host rounds at equal tau (BENCHMARKS.md#one-graph-chain-rounds-2026-12-01-1349-utc-after-the-5-epoch-gpu-preset,
    BENCHMARKS.md#the-benchs-tree-default-on-the-gpu-one-graph-rounds-compiled-proposer). `eyas bench` and recipes' [[bench]] tables both take it."""
    return device.startswith("cuda") and temperature == 0


def for_drafter(cfg: BenchConfig, drafter) -> BenchConfig:
    """The config `drafter` runs: unchanged for EAGLE-3; for DFlash, k = B-1 unless given (a given k > B-1 and
    trees are refused)."""
    if drafter is None or not is_dflash(drafter):
        return cfg
    resolved = replace(cfg, k=cfg.spec.k if cfg._k_given else block_drafts(drafter))
    check_spec(resolved.spec, drafter)
    return resolved


def method_label(spec: SpecConfig, drafter) -> str:
    """What the drafter's method row means, e.g. "dflash block 16 (15 drafts)", "eagle-3 chain of 5 drafts"."""
    if is_dflash(drafter):
        return f"dflash block {drafter.config.block_size} ({spec.k} drafts)"
    if spec.method == "tree":
        return f"eagle-3 tree (top-k {spec.top_k}, depth {spec.depth}, {spec.total_tokens} nodes)"
    return f"eagle-3 chain of {spec.k} drafts"


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Method:
    """One decoding method over all conversations: outputs, stats and wall time."""

    def __init__(self, name, decode, decoder=None, label=None):
        self.name, self.decode, self.decoder, self.label = name, decode, decoder, label or name
        self.stats, self.seconds, self.outputs = SpecStats(), 0.0, []
        self.per_record: list[list[int]] = []   # [tokens, target forwards] of each record (all its turns)

    def report(self) -> dict:
        s = self.stats
        return {"label": self.label, "tokens": s.tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(s.tokens / self.seconds, 2) if self.seconds else None,
                "tau": round(s.tau, 4), "tau_ci95": tau_interval(self.per_record), "per_record": self.per_record,
                "target_forwards": s.target_forwards, "rounds": s.rounds,
                "acceptance_by_position": [round(a, 4) for a in s.acceptance_by_position()]}


def tau_interval(per_record: list[list[int]], reps: int = 2000, seed: int = 0) -> list[float] | None:
    """95% percentile-bootstrap interval of tau = total tokens / total target forwards, resampling records (a
    record's turns share context, so they move together); None below two records. How far a tau measured on a
    few dozen prompts can be trusted: per-prompt tau spreads widely."""
    n = len(per_record)
    if n < 2:
        return None
    rng = random.Random(seed)
    taus = []
    for _ in range(reps):
        tok = fw = 0
        for _ in range(n):
            t, f = per_record[rng.randrange(n)]
            tok, fw = tok + t, fw + f
        taus.append(tok / max(fw, 1))
    taus.sort()
    return [round(taus[int(0.025 * reps)], 4), round(taus[int(0.975 * reps) - 1], 4)]


def run_bench(cfg: BenchConfig, *, target=None, drafter=None, drafter_meta: dict | None = None,
              records: list[dict] | None = None, out=None, warm_only: bool = False) -> dict:
    """Run the benchmark; return (and optionally write) the report dict.

    warm_only: set up and warm up exactly as the bench does (runner, methods, every shape, a short decode), then
    return the report's warm-up part without decoding the prompt set or writing anything: what `eyas run` runs in
    another process during training (bench/prewarm.py), so that the compile caches on disk (and the saved steps,
    with persist_steps) hold every graph this bench builds. The drafter's weights do not matter, its config does."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    with compile_cache(cfg.compile) as cache_info:
        report = _run(cfg, target, drafter, drafter_meta, records, out, warm_only)
    report["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    if cfg.compile:
        report["compile_cache"] = cache_info
    if not warm_only:
        write_report(report, cfg.json_out, out)
    return report


def _run(cfg, target, drafter, drafter_meta, records, out, warm_only=False) -> dict:
    clock = time.perf_counter()
    cfg, target, drafter, meta = _open(cfg, target, drafter, drafter_meta, out)
    tok = target.tokenizer
    skipped = {"too_long": 0, "too_short": 0}
    if records is None:
        records, _ = load_bench_prompts(cfg, tok, skipped)
    if not records:
        raise EyasError(f"{cfg.prompts}: empty prompt set")
    runner = target_runner(cfg, target)
    eos, room = target.eos_token_ids, prompt_room(cfg)
    methods = _methods(cfg, runner, drafter, eos)
    seconds = {"load": time.perf_counter() - clock}
    before, saved = runner.graph_count, saved_steps(runner)

    clock = time.perf_counter()
    shapes = _warm_up(cfg, runner, methods, drafter, prompt_ids(tok, first_messages(records[0]), room)[0])
    seconds["warmup"] = time.perf_counter() - clock
    # built: runner shapes this bench's warm-up added (0 when an earlier bench or warm-up of this process built them)
    warm = {"shapes": shapes, "built": shapes - before}
    if warm_only:
        return {"config": cfg.to_dict(), "target": target.fingerprint, "device": str(runner.device),
                "warmup": {**warm, **_saved_delta(cfg, runner, saved)},
                "seconds": {k: round(v, 3) for k, v in seconds.items()}}

    clock = time.perf_counter()
    truncated = _decode_all(methods, records, tok, room, cfg, runner.device)
    seconds["decode"] = time.perf_counter() - clock
    late = runner.graph_count - shapes  # runner shapes first built inside the timed loop
    if late:
        print(f"warning: {late} runner shape(s) were compiled or captured inside the timed loop; the speeds "
              f"include that time", file=out)
    if truncated:
        print(f"warning: {truncated} prompt(s) longer than {room} tokens were left-truncated", file=out)
    report = {"config": cfg.to_dict(), "target": target.fingerprint, "drafter": meta.get("source"),
              "drafter_kind": None if drafter is None else getattr(drafter, "kind", "eagle3"),
              **({"block_size": drafter.config.block_size} if is_dflash(drafter) else {}),
              "device": str(runner.device), "dtype": DTYPE_NAMES.get(runner.dtype, str(runner.dtype)),
              "records": len(records), "turns": sum(len(r["turns"]) for r in records),
              "truncated": truncated, "skipped_long_prompts": skipped["too_long"],
              "skipped_short_prompts": skipped["too_short"], "prompts": prompt_summary(records, tok),
              "methods": {m.name: m.report() for m in methods},
              "warmup": {**warm, "late_shapes": late, **_saved_delta(cfg, runner, saved)}}
    tau_by_kind(report, records)
    _speedups(report, methods)
    clock = time.perf_counter()
    if cfg.spec.temperature == 0:
        report.update(_lossless(cfg, target, runner, drafter, methods, records, room, report["dtype"]))
    seconds["lossless_check"] = time.perf_counter() - clock
    report["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    return report


def _open(cfg, target, drafter, drafter_meta, out) -> tuple[BenchConfig, object, object, dict]:
    """(the config the drafter runs, the target, the drafter, its metadata): the target loaded unless given, and
    the drafter opened from cfg.drafter unless given, each refused when it was trained for another target."""
    if target is None:
        dt = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        target = eyas.target.load_target(cfg.target, device=cfg.device, dtype=dt,
                                         trust_remote_code=cfg.trust_remote_code)
    if target.tokenizer is None:
        raise EyasError(f"target {cfg.target!r} has no tokenizer; bench needs one to apply the chat template")
    meta = dict(drafter_meta or {})
    opened = drafter is None and cfg.drafter is not None
    if opened:
        drafter, meta = open_drafter(cfg.drafter, target)  # checks the recorded target
    if drafter is not None:
        if meta.get("target") and not opened:  # a drafter passed in: refuse one trained for another target
            check_same(meta["target"], target.fingerprint, what="drafter's target", where=meta.get("source", "drafter"))
        if tuple(drafter.config.aux_layer_ids) != tuple(target.aux_layer_ids) and meta.get("target") is None:
            print(f"note: drafter aux layers {list(drafter.config.aux_layer_ids)} differ from the target default "
                  f"{list(target.aux_layer_ids)}; using the drafter's", file=out)
        cfg = for_drafter(cfg, drafter)
    return cfg, target, drafter, meta


def target_runner(cfg: BenchConfig, target) -> Runner:
    """The runner of cfg's shape on the target: one per target and shape, kept in target.runners, so a later bench
    of the same target (eyas run's benches, a warm-up's bench) does not compile and capture its graphs again."""
    key = (cfg.max_seq, str(target.device), cfg.compile, cfg.persist_steps)
    runner = target.runners.get(key)
    if runner is None:
        runner = Runner.from_hf(target.model, max_batch=1, max_seq=cfg.max_seq, device=target.device,
                                compile=cfg.compile, persist=Path(cache_root()) / "steps" if cfg.persist_steps else None)
        if isinstance(runner, Runner):  # the generic HFRunner compiles and captures nothing: made anew each time
            target.runners[key] = runner
    return runner


def _speedups(report: dict, methods: list[Method]) -> None:
    """Each method's speedup in the report: its tokens/s over plain decoding's (none without plain)."""
    plain = next((m for m in methods if m.name == "plain"), None)
    for m in methods:
        if plain is not None and m is not plain and plain.seconds and m.seconds:
            report["methods"][m.name]["speedup"] = round(
                (m.stats.tokens / m.seconds) / (plain.stats.tokens / plain.seconds), 3)


def _lossless(cfg, target, runner, drafter, methods, records, room, dtype: str) -> dict:
    """A greedy bench's checks against plain greedy: "agreement" in the bench's dtype, and "lossless": the bench
    itself in fp32, else an fp32 rerun of the first cfg.lossless_turns turns ({} for what does not apply)."""
    plain = next((m for m in methods if m.name == "plain"), None)
    spec = {m.name: m.outputs for m in methods if m is not plain}
    out = {}
    if plain is not None:
        out["agreement"] = {n: {"dtype": dtype, **agreement(o, plain.outputs)} for n, o in spec.items()}
    if plain is not None and runner.dtype == torch.float32:  # the bench itself is the exact check
        out["lossless"] = lossless_verdict(spec, plain.outputs, dtype=runner.dtype, rerun=False)
    elif cfg.lossless_turns and spec:
        out["lossless"] = _fp32_rerun(cfg, target, runner, drafter, records, room, set(spec))
    return out


def _saved_delta(cfg, runner, before: dict) -> dict:
    """With persist_steps: {"saved_steps": the runner's saved compiled steps loaded / compiled and saved / fallen
    back to plain compiles since `before`}; else {}."""
    if not cfg.persist_steps:
        return {}
    now = saved_steps(runner)
    return {"saved_steps": {k: now[k] - before[k] for k in now}}


def _methods(cfg, runner, drafter, eos, *, baselines=None) -> list[Method]:
    baselines = cfg.baselines or drafter is None if baselines is None else baselines
    methods = []
    if baselines:
        methods.append(Method("plain", lambda p, seed, n=cfg.max_new_tokens: _plain(runner, p, n, cfg, eos, seed)))
        # With a drafter, lookup verifies through the eagle decoder's step (its aux output unused; with graph rounds,
        # the round's): one compiled S-generic function for both instead of two, one cold compile fewer.
        share = tuple(drafter.config.aux_layer_ids) if drafter is not None else None
        lk = SpecDecoder(runner, None, cfg.lookup, verify_capture=share)
        methods.append(Method("lookup", lambda p, seed, n=cfg.max_new_tokens: lk.generate(p, n, eos_ids=eos, seed=seed),
                               lk))
    if drafter is not None:
        # A compiled runner compiles the drafter's steps too: with an eager drafter the rounds are slower
        # (BENCHMARKS.md#speculative-round-profile-2026-11-30-1220-utc).
        dec = SpecDecoder(runner, drafter, cfg.spec, compile_drafter=runner.compiled)
        methods.append(Method("dflash" if is_dflash(drafter) else f"eagle-{cfg.spec.method}",
                              lambda p, seed, n=cfg.max_new_tokens: dec.generate(p, n, eos_ids=eos, seed=seed), dec,
                              method_label(cfg.spec, drafter)))
    return methods


def _warm_up(cfg, runner, methods, drafter, first: list[int]) -> int:
    """Warm-up, not timed: compile and capture every shape of the timed loop (the fixed shape set of this bench's
    methods, see startup.py), then decode a few rounds of the prompt `first` per method (paths the shape set does
    not name, e.g. a drafter's chain graph); a few rounds reach every path, a whole reply would only add decoding
    time outside the clock (`late_shapes` checks the runner's shapes; the drafters' graphs are all captured in
    their first round or here). Returns the runner's shapes after the shape set."""
    shapes = _warm_shapes(cfg, runner, methods, drafter)
    for m in methods:
        m.decode(first, cfg.seed, min(cfg.max_new_tokens, 4 * (cfg.spec.max_depth + 1) + 8))
    _sync(runner.device)
    return shapes


def _warm_shapes(cfg, runner, methods, drafter) -> int:
    """Compile and capture the fixed shape set of this bench's methods (see startup.py)."""
    steps, drafters, c = [], [], cfg.spec
    for m in methods:
        if m.decoder is None:
            steps.append((None, verify_shapes("plain", c.k, 0)))
            continue
        kind = "lookup" if m.name == "lookup" else c.method
        size = tree_nodes(c.top_k, c.depth, c.total_tokens, drafter.config.draft_vocab_size) if kind == "tree" else 0
        # a one-graph round compiles its verify inside its own capture, in the warm-up decode after this
        if m.decoder.mode != "round":
            steps.append((runner.step_fn(m.decoder.verify_capture), verify_shapes(kind, c.k, size)))
        if kind == "lookup":  # an empty lookup draft (S = 1): the plain decode step on CUDA, the verify step elsewhere
            steps.append((m.decoder.step_for(1), verify_shapes("plain", c.k, 0)))
        if m.decoder.mode == "static":  # static drafters (chains, DFlash blocks, trees): extends of 1..K+1
            depth = c.k if kind == "chain" else c.depth  # a tree accepts up to `depth` drafts + the bonus
            drafters.append((m.decoder.drafting, len(m.decoder.aux_ids) * runner.cfg.hidden_size, depth))
    return warm_up(runner, steps, drafters)


def prompt_room(cfg: BenchConfig) -> int:
    """Prompt tokens a turn may take (longer prompts are left-truncated): max_seq less the reply and a draft.
    The engine bench (engine.py) cuts by the same rule, so both benches send the same prompts."""
    room = cfg.max_seq - cfg.max_new_tokens - max(cfg.spec.draft_size, cfg.spec.k) - 2
    if room < 8:
        raise EyasError(f"max_seq {cfg.max_seq} leaves no room for prompts with {cfg.max_new_tokens} new tokens "
                        f"and a {cfg.spec.draft_size}-token draft")
    return room


def _decode_all(methods, records, tok, room, cfg, device) -> int:
    """Answer every turn of every record with each method (own earlier answers as context); timed per method.
    Returns the number of left-truncated prompts (counted once, on the first method)."""
    truncated = 0
    for ri, rec in enumerate(records):
        for m in methods:
            msgs, outs = [dict(c) for c in rec.get("context", ())], []   # a fixed context: as written
            m.per_record.append([0, 0])
            for ti, turn in enumerate(rec["turns"]):
                msgs.append({"role": "user", "content": turn})
                ids, cut = prompt_ids(tok, msgs, room)
                truncated += cut and m is methods[0]
                _sync(device)
                t0 = time.perf_counter()
                new, st = m.decode(ids, cfg.seed + 1000 * ri + ti)
                _sync(device)
                m.seconds += time.perf_counter() - t0
                m.stats.add(st)
                m.per_record[-1][0] += st.tokens
                m.per_record[-1][1] += st.target_forwards
                outs.append(new)
                msgs.append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)})
            m.outputs.append(outs)
    return truncated


def _fp32_rerun(cfg, target, runner, drafter, records, room, benched) -> dict:
    """The exact lossless check: the first cfg.lossless_turns turns again in fp32 (same weights, upcast),
    plain greedy and every speculative method; each must reproduce plain greedy token for token."""
    r32 = fp32_runner(runner, target.model, target.runners, (cfg.max_seq, str(runner.device), "fp32-check"))
    with exact_fp32():
        methods = [m for m in _methods(cfg, r32, fp32_drafter(drafter), target.eos_token_ids, baselines=True)
                   if m.name == "plain" or m.name in benched]
        _decode_all(methods, first_turns(records, cfg.lossless_turns), target.tokenizer, room, cfg, r32.device)
    plain = methods[0]
    return lossless_verdict({m.name: m.outputs for m in methods[1:]}, plain.outputs, dtype=r32.dtype, rerun=True)


def _plain(runner, prompt, n, cfg, eos, seed):
    # window=0: every step attends over all max_seq slots, like the speculative verify steps, so plain decoding
    # has one graph shape (the warmed one) instead of one per prompt-length window compiled inside the clock
    out = runner.generate([prompt], n, temperature=cfg.spec.temperature, top_p=cfg.spec.top_p,
                          eos_ids=eos, seed=seed, window=0)[0]
    return out, SpecStats(tokens=len(out), target_forwards=len(out))
