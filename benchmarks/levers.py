"""Rank training levers of the gpu preset in short, equal runs from one prepared dataset (issue 33, goal 2).

Each lever is a set of gpu-recipe values (`eyas run --set` keys) on top of the preset. `one` trains a drafter with
the preset's train config plus the lever, for a fixed number of steps, from the same prepared data and seed, then
benches it on held-out ShareGPT with the preset's first bench (chain-5, graph rounds) at a fixed --limit; it writes
ROOT/LEVER/row.json. `table` turns the rows into a markdown table (and a PNG). benchmarks/levers.sh drives it.

    python benchmarks/levers.py list
    python benchmarks/levers.py one LEVER --root ROOT --target T --prepared PREP --steps N --limit L [--set K=V ...]
    python benchmarks/levers.py table ROOT [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

# Model levers: the same prepared data, only the training changes. In order of expected value (the default list of
# levers.sh takes the first ones). "steps" multiplies the common step budget (the epochs lever).
LEVERS = {
    "base": {},
    "lk_lambda": {"train.loss": "lk_lambda"},      # LK hybrid loss: CE early, acceptance rate once alpha is high
    "nonorm": {"train.norm_before_fc": False},      # without EAGLE 3.1's norm before fc (the gpu preset trains it)
    "all": {"train.loss_on": "all"},               # prompt positions train too: more labelled positions per step
    "lk_alpha": {"train.loss": "lk_alpha"},        # pure -log alpha
    "ttt7": {"train.ttt_steps": 7},                # EAGLE-3's K (the preset trains 6)
    "vocab16k": {"train.draft_vocab": 16384},
    "vocab_full": {"train.draft_vocab": 49152},    # SmolLM2's whole vocabulary: no position masked as out-of-vocab
    "init": {"train.init_from_target": True},      # norm and LM head start from the target's
    "lr2x": {"train.lr": 2e-3},
    "lr_half": {"train.lr": 5e-4},
    "steps2x": {"steps": 2},                       # twice the budget: how much more training alone buys
}
# Data levers: a new prepare each (the preset's prepare plus the lever), then the same training and bench.
DATA_LEVERS = {
    # the greedy set as #s1 and one sampled at 0.7: the eval scores #s1, so its acc_k compare with the base's
    "spp2": {"prepare.samples_per_prompt": 2, "prepare.regen_temperature": 0.7, "prepare.greedy_sample": True},
    "self8k": {"prepare.self_prompts": 8000},                                      # + 8,000 self-written prompts
}
BENCH = "sharegpt-heldout-chain5"   # the preset's headline bench


def lever(name: str) -> dict:
    if name in LEVERS:
        return LEVERS[name]
    if name in DATA_LEVERS:
        return DATA_LEVERS[name]
    raise SystemExit(f"levers.py: unknown lever {name!r}; known: {' '.join([*LEVERS, *DATA_LEVERS])}")


def stages(target: str, overrides: dict, out: Path, vocab_size: int | None):
    """The gpu preset's stage configs with `overrides` applied, as `eyas run --preset gpu --set ...` resolves them."""
    from eyas.run import RunConfig, resolve_stages

    cfg = RunConfig(preset="gpu", target=target, out=str(out), overrides=overrides, quiet=True)
    return cfg, resolve_stages(cfg, out, vocab_size=vocab_size, progress=False)


def _subparser(command: str) -> argparse.ArgumentParser:
    from eyas.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flags(command: str, values: dict) -> tuple[list[str], dict]:
    """`eyas COMMAND` flags that set `values` (field -> value) where they differ from the flag's default, and the
    fields that no flag of COMMAND sets (with their values)."""
    out, rest = [], dict(values)
    for a in _subparser(command)._actions:
        if a.dest not in values or not a.option_strings:
            continue
        v = rest.pop(a.dest)
        if v == a.default:
            continue
        if isinstance(a, argparse._StoreTrueAction):
            out.append(a.option_strings[0])
        elif isinstance(a, argparse._StoreFalseAction):
            out.append(a.option_strings[0])
        elif v is not None:
            out += [a.option_strings[0], str(v)]
    return out, rest


def train_flags(cfg) -> tuple[list[str], dict]:
    """A TrainConfig as `eyas train` flags, and its non-default fields that are not flags (e.g. the recipe's
    log_every)."""
    from eyas.train.config import TrainConfig

    values = {f.name: getattr(cfg, f.name) for f in fields(TrainConfig)}
    out, rest = flags("train", values)
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    return out, {k: v for k, v in rest.items() if v != defaults[k]}


def bench_flags(bc, dtype: str) -> list[str]:
    """A BenchConfig (chain, greedy) on a target loaded in `dtype` as `eyas bench` flags."""
    values = {f.name: getattr(bc, f.name) for f in fields(bc) if f.name not in ("spec", "prompts", "dtype")}
    out, _ = flags("bench", values)
    return (["--prompts", bc.prompts, "--dtype", dtype] + out + ["--chain", str(bc.spec.k)]
            + (["--graph-round"] if bc.spec.graph_round else []))


def _delta(base: list[str], mine: list[str]) -> str:
    """The flags of `mine` that `base` does not have (as pairs: --flag value), then `without --flag` for each flag
    of `base` that `mine` lacks (a switch the lever turns off)."""
    def pairs(xs):
        out, i = [], 0
        while i < len(xs):
            takes = i + 1 < len(xs) and not xs[i + 1].startswith("--")
            out.append(" ".join(xs[i:i + 1 + takes]))
            i += 1 + takes
        return out
    have, own = pairs(base), pairs(mine)
    names = {p.split()[0] for p in own}
    return " ".join([p for p in own if p not in have] + [f"without {p}" for p in have if p.split()[0] not in names])


def lever_bench(c, out: Path, *, limit: int, compile: bool, baselines: bool):
    """The preset's headline bench on the lever's drafter, at `limit` prompts, without the lossless rerun.
    Persisted steps are compiled steps: kept only when the bench compiles."""
    bc = c.bench[BENCH]
    return replace(bc, drafter=str(out / "train"), limit=limit, compile=compile,
                   persist_steps=compile and bc.persist_steps, baselines=baselines, lossless_turns=0,
                   json_out=str(out / "bench.json"))


def run_one(args) -> int:
    import torch

    from eyas.bench.bench import run_bench
    from eyas.model.checkpoint import open_drafter
    from eyas.recipes import resolve_dtype
    from eyas.run import parse_knob
    from eyas.target import load_target
    from eyas.train.trainer import run_train

    spec = lever(args.lever)
    common = dict(parse_knob(s) for s in args.set)
    mine = {**common, **{k: v for k, v in spec.items() if k != "steps"}}
    steps = args.steps * spec.get("steps", 1)
    out = Path(args.root) / args.lever
    out.mkdir(parents=True, exist_ok=True)
    row = {"lever": args.lever, "set": {k: v for k, v in spec.items()}, "common_set": common, "steps": steps}

    t0 = time.perf_counter()
    cfg, _ = stages(args.target, mine, out, None)   # refuses a bad value before the target is loaded
    r = cfg.recipe.run
    dname = resolve_dtype(r.dtype, r.device)   # the target's dtype for every stage, as eyas run loads it
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dname]
    target = load_target(args.target, device=r.device, dtype=dtype)
    _, c = stages(args.target, mine, out, target.vocab_size)
    _, b = stages(args.target, common, out, target.vocab_size)
    row["load_s"] = round(time.perf_counter() - t0, 1)

    prepared = args.prepared
    if any(k.startswith("prepare.") for k in spec):     # a data lever: its own prepared data
        from eyas.data.prepare import run_prepare

        t0 = time.perf_counter()
        pc = replace(c.prepare, out=str(out / "prepared"))
        row["prepare"] = run_prepare(pc, target, progress=False)["counts"]
        row["prepare_s"] = round(time.perf_counter() - t0, 1)
        prepared = pc.out
    budget = dict(data=prepared, out=str(out / "train"), steps=steps, epochs=None, eval_every=steps,
                  checkpoint_every=0, progress=False, resume=True)
    # the base at the common budget: a steps lever's flags then show its own --steps
    tc = replace(c.train, **budget)
    base_tc = replace(b.train, **{**budget, "steps": args.steps, "eval_every": args.steps})
    mine_flags, not_flags = train_flags(tc)
    row["train_command"] = "eyas train " + " ".join(mine_flags)
    row["not_flags"] = not_flags
    row["flags"] = _delta(train_flags(base_tc)[0], mine_flags) or "(the preset's)"
    if prepared != args.prepared:   # a data lever: what its prepare changed
        pf = lambda pc: flags("prepare", {f.name: getattr(pc, f.name) for f in fields(pc)})[0]   # noqa: E731
        row["flags"] = f"prepare {_delta(pf(b.prepare), pf(c.prepare))}; train {row['flags']}"
    (out / "row.json").unlink(missing_ok=True)

    t0 = time.perf_counter()
    result = run_train(tc, target)
    row["train_s"] = round(time.perf_counter() - t0, 1)
    # a resumed run that had already reached its steps returns no eval: its metrics.jsonl holds it
    row["eval"] = _eval_of(result.get("eval") or last_eval(out / "train"))
    row["vocab_coverage"] = result.get("vocab_coverage")
    rates = [json.loads(x).get("tokens_per_s") for x in (out / "train" / "metrics.jsonl").read_text().splitlines()
             if '"split": "train"' in x]
    row["tokens_per_s"] = next((x for x in reversed(rates) if x), None)

    bc = lever_bench(c, out, limit=args.limit, compile=args.bench_compile, baselines=args.baselines)
    row["bench_command"] = "eyas bench " + " ".join(bench_flags(bc, dname))
    t0 = time.perf_counter()
    drafter, meta = open_drafter(out / "train", target)
    rep = run_bench(bc, target=target, drafter=drafter.to(target.device), drafter_meta=meta, out=sys.stdout)
    row["bench_s"] = round(time.perf_counter() - t0, 1)
    row["bench"] = {m: {k: v.get(k) for k in ("tau", "tau_ci95", "tokens_per_s", "acceptance_by_position")}
                    for m, v in rep["methods"].items()}
    row["bench_records"] = rep.get("records")
    row["device"] = torch.cuda.get_device_name() if r.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    row["torch"] = torch.__version__
    (out / "row.json").write_text(json.dumps(row, indent=1))
    print(f"levers: {args.lever}: {steps} steps in {row['train_s']} s, eval acc_0 "
          f"{(ev.get('acc_k') or [float('nan')])[0]:.3f}, chain-5 tau {row['bench']['eagle-chain']['tau']:.3f}")
    return 0


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


EVAL_KEYS = ("acc_k", "cond_acc_k", "tau_est", "round_tau_by_chain", "round_tau_first_by_chain", "alpha_k",
             "baseline_acc_0")


def _eval_of(ev: dict) -> dict:
    return {k: ev.get(k) for k in EVAL_KEYS}


def last_eval(train_dir: Path) -> dict:
    """The last held-out eval line of a training run's metrics.jsonl ({} when there is none)."""
    path = train_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return next((json.loads(x) for x in reversed(lines) if '"split": "eval"' in x), {})


def rows_of(root: Path) -> list[dict]:
    """The finished rows under ROOT, in the order the job ran them (ROOT/order, else by name). A row without its
    eval (written by a resumed run) takes it from the lever's metrics.jsonl."""
    order = (root / "order").read_text().split() if (root / "order").exists() else sorted(
        p.parent.name for p in root.glob("*/row.json"))
    rows = [json.loads((root / n / "row.json").read_text()) for n in order if (root / n / "row.json").exists()]
    for r in rows:
        if not (r.get("eval") or {}).get("acc_k"):
            r["eval"] = _eval_of(last_eval(root / r["lever"] / "train"))
    return rows


def table(rows: list[dict], *, command: str = "") -> str:
    """The levers as a markdown section: one row per lever, tau against the job's base row."""
    if not rows:
        return "no lever has finished yet\n"
    base = next((r for r in rows if r["lever"] == "base"), None)
    tau = lambda r: r["bench"]["eagle-chain"]["tau"]   # noqa: E731
    first = rows[0]
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    lines = [f"## Training levers, equal budgets, one prepared dataset — {when}",
             "", f"- machine: {first['device']}; torch {first['torch']}"]
    if command:
        lines.append(f"- command: `{command}`")
    lines += [f"- every lever: `{(base or first)['train_command']}` plus the lever's flags"
              + (f" (and, not flags: {json.dumps(first['not_flags'])})" if first.get("not_flags") else ""),
              f"- bench: `{first['bench_command']}` ({first.get('bench_records')} held-out records)"]
    if base and "lookup" in base["bench"]:
        lk = base["bench"]["lookup"]["tau"]
        lines.append(f"- prompt lookup on the same prompts: tau {lk:.2f}; base / lookup {tau(base) / lk:.3f}x")
    lines += ["", "| lever | `eyas train` flags | steps | train s | bench s | tok/s | held-out acc_0..k (eval) | "
              "eval chain-5 tau (first replies) | chain-5 tau (95% interval) | vs base |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ev = r.get("eval") or {}
        acc = " ".join(f"{a:.3f}" for a in ev.get("acc_k") or [])
        first5 = (ev.get("round_tau_first_by_chain") or [])
        ci = r["bench"]["eagle-chain"].get("tau_ci95")
        vs = f"{tau(r) / tau(base):.3f}x" if base and r is not base else ("1.000x" if r is base else "-")
        sec = f"{r['train_s']:.0f}" + (f" (+ prepare {r['prepare_s']:.0f})" if r.get("prepare_s") else "")
        lines.append(f"| {r['lever']} | `{r['flags']}` | {r['steps']} | {sec} | {_f(r.get('bench_s'), '.0f')} | "
                     f"{_f(r.get('tokens_per_s'), ',.0f')} | {acc} | {_f(first5[4] if len(first5) > 4 else None)} | "
                     f"{tau(r):.3f}"
                     f"{f' ({ci[0]:.2f}-{ci[1]:.2f})' if ci else ''} | {vs} |")
    lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Chain-5 tau per lever with its interval, the base's as a line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [r["lever"] for r in rows]
    taus = [r["bench"]["eagle-chain"]["tau"] for r in rows]
    cis = [r["bench"]["eagle-chain"].get("tau_ci95") or [t, t] for r, t in zip(rows, taus)]
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(rows), 3.5))
    ax.bar(names, taus, yerr=[[t - c[0] for t, c in zip(taus, cis)], [c[1] - t for t, c in zip(taus, cis)]],
           capsize=3, color="tab:blue")
    if "base" in names:
        ax.axhline(taus[names.index("base")], color="gray", ls="--", lw=1)
    ax.set_ylabel("held-out chain-5 tau")
    ax.set_title(f"levers at {rows[0]['steps']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the levers and their recipe values")
    o = sub.add_parser("one", help="train and bench one lever")
    o.add_argument("lever")
    o.add_argument("--root", required=True)
    o.add_argument("--target", required=True)
    o.add_argument("--prepared", required=True, help="the prepared-data directory every model lever trains from")
    o.add_argument("--steps", type=int, required=True)
    o.add_argument("--limit", type=int, required=True, help="held-out bench records")
    o.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe value for every lever, base included (e.g. run.device=cpu for a rehearsal)")
    o.add_argument("--baselines", action="store_true", help="also bench plain decoding and prompt lookup")
    o.add_argument("--bench-compile", action="store_true", help="compile the bench's target steps (tau unchanged)")
    t = sub.add_parser("table", help="the finished levers as markdown")
    t.add_argument("root")
    t.add_argument("--md")
    t.add_argument("--command", default="")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for name, spec in {**LEVERS, **DATA_LEVERS}.items():
            print(f"{name:11s} {'data ' if name in DATA_LEVERS else 'model'} {json.dumps(spec)}")
        return 0
    if args.cmd == "one":
        return run_one(args)
    rows = rows_of(Path(args.root))
    md = table(rows, command=args.command)
    print(md)
    if args.md:
        Path(args.md).write_text(md)
        if rows:
            plot(rows, Path(args.md).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
