"""RUN/report.md and its plots, built only from what the stages wrote (no number is typed in)."""

from __future__ import annotations

import json
from pathlib import Path


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _plots(run: Path, metrics: list[dict], bench: dict) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, made = run / "plots", {}
    out.mkdir(exist_ok=True)
    train = [m for m in metrics if m.get("split") == "train"]
    evals = [m for m in metrics if m.get("split") == "eval"]
    if train:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([m["step"] for m in train], [m["loss"] for m in train], label="train loss")
        if evals:
            ax.plot([m["step"] for m in evals], [m["loss"] for m in evals], "o-", label="held-out loss")
        ax.set_xlabel("optimizer step"), ax.set_ylabel("TTT loss"), ax.legend(), ax.grid(alpha=0.3)
        fig.tight_layout(), fig.savefig(out / "loss.png", dpi=110), plt.close(fig)
        made["loss"] = "plots/loss.png"
        fig, ax = plt.subplots(figsize=(6, 3.5))
        K = len(train[-1]["acc_k"])
        for k in range(K):
            ax.plot([m["step"] for m in train], [m["acc_k"][k] for m in train], label=f"acc_{k}")
        ax.set_xlabel("optimizer step"), ax.set_ylabel("top-1 agreement with target (train)")
        ax.legend(ncol=2, fontsize=8), ax.grid(alpha=0.3)
        fig.tight_layout(), fig.savefig(out / "acc_k.png", dpi=110), plt.close(fig)
        made["acc_k"] = "plots/acc_k.png"
    scaled = [m for m in evals if m.get("tokens_seen")]
    if scaled:
        made["scaling"] = _scaling_plot(plt, out / "scaling.png", scaled, bench)
    if bench:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, r in bench.items():
            for m, v in r["methods"].items():
                acc = v.get("acceptance_by_position") or []
                if m != "plain" and acc:
                    ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"{name}: {m}")
        ax.set_xlabel("draft position"), ax.set_ylabel("acceptance rate"), ax.set_ylim(0, 1)
        ax.legend(fontsize=7), ax.grid(alpha=0.3)
        fig.tight_layout(), fig.savefig(out / "acceptance.png", dpi=110), plt.close(fig)
        made["acceptance"] = "plots/acceptance.png"
    return made


def _scaling_plot(plt, path: Path, evals: list[dict], bench: dict) -> str:
    """Held-out acc_k and tau_est against training tokens seen, with the measured bench tau of the final drafter:
    whether more data or more steps would still help."""
    x = [m["tokens_seen"] for m in evals]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for k in range(len(evals[-1]["acc_k"])):
        ax.plot(x, [m["acc_k"][k] for m in evals], "o-", ms=3, label=f"held-out acc_{k}")
    ax.set_xscale("log"), ax.set_xlabel("training tokens seen"), ax.set_ylabel("held-out top-1 agreement")
    ax.grid(alpha=0.3)
    tx = ax.twinx()
    tx.plot(x, [m["tau_est"] for m in evals], "k--", label="tau_est (training eval)")
    for name, r in bench.items():
        eagle = next((v for m, v in r.get("methods", {}).items() if is_drafter(m)), None)
        if eagle and eagle.get("tau"):
            tx.plot([x[-1]], [eagle["tau"]], "*", ms=10, label=f"bench tau: {name}")
    tx.set_ylabel("tau")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = tx.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="lower right")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
    return f"plots/{path.name}"


def _fmt(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def is_drafter(method: str) -> bool:
    """A bench method row that a drafter ran ("eagle-chain", "eagle-tree", "dflash"), not a baseline."""
    return method.startswith("eagle") or method == "dflash"


def _prompts_note(r: dict, eagle: dict) -> str:
    """'; 30 prompts of 2065-5754 tokens (15 conversation tau 2.1, 15 document tau 2.6)' for a bench whose
    prompts have kinds (the long set), else ''."""
    p = r.get("prompts")
    if not p or not p.get("kinds"):
        return ""
    taus = eagle.get("tau_by_kind", {})
    kinds = ", ".join(f"{n} {k}" + (f" tau {taus[k]:.2f}" if k in taus else "") for k, n in p["kinds"].items())
    return f"; {r['records']} prompts of {p['tokens']['min']}-{p['tokens']['max']} tokens ({kinds})"


def write_report(run: Path, state: dict, cfg) -> str:
    """Write RUN/report.md; return the one-screen summary printed at the end of `eyas run`."""
    stages = state["stages"]
    metrics = _read_metrics(run / "train" / "metrics.jsonl")
    bench = {p.stem: json.loads(p.read_text()) for p in sorted((run / "bench").glob("*.json"))}
    plots = _plots(run, metrics, bench)
    data = stages.get("prepare", {}).get("summary", {})
    store = stages.get("capture", {}).get("summary")
    train = stages.get("train", {}).get("summary", {})
    export = stages.get("export", {}).get("summary", {})
    L = _header(run, state, cfg) + _stages_table(stages) + _data_section(data) + _store_section(store)
    L += _training_section(train, metrics, plots)
    L += _bench_section(bench, stages.get("bench", {}).get("seconds"), plots)
    L += _export_section(export)
    (run / "report.md").write_text("\n".join(L) + "\n")
    return _summary(run, cfg, data, store, train.get("eval") or {}, bench, export)


def _header(run: Path, state: dict, cfg) -> list[str]:
    L = [f"# eyas run report: {cfg.preset}", "",
         f"Target `{cfg.target}`, data `{cfg.data}`, run directory `{run}`, started {state.get('created')}.", ""]
    if cfg.preset == "cpu-demo":
        L += ["This is the CPU demonstration preset: small data and short training. For a real drafter run "
              "`eyas run --preset gpu` on a CUDA machine.", ""]
    return L


def _stages_table(stages: dict) -> list[str]:
    L = ["## Stages", "", "| stage | seconds |", "|---|---|"]
    L += [f"| {s} | {v.get('seconds', 0):.0f} |" for s, v in stages.items()]
    total = sum(v.get("seconds", 0) for v in stages.values())
    return L + [f"| total | {total:.0f} |", ""]


def _data_section(c: dict) -> list[str]:
    """The prepare stage's counts; any count beyond the plain ones is regeneration's."""
    L = ["## Data", "", f"- conversations read: {c.get('read')}, kept for training: {c.get('kept')}, "
         f"held out for bench: {c.get('heldout')}",
         f"- tokens: {c.get('tokens')}, trainable (assistant) tokens: {c.get('trainable_tokens')}, "
         f"truncated conversations: {c.get('truncated')}"]
    for what in ("skipped", "dropped"):
        for reason, n in sorted((c.get(what) or {}).items()):
            L.append(f"- {what}: {reason}: {n}")
    regen = {k: v for k, v in c.items() if k not in ("read", "kept", "heldout", "tokens", "trainable_tokens",
                                                     "truncated", "skipped", "dropped")}
    if regen:
        L.append("- regeneration: " + ", ".join(f"{k} {_fmt(v, 1)}" for k, v in regen.items()))
    return L + [""]


def _store_section(store: dict | None) -> list[str]:
    if not store:
        return []
    return ["## Hidden-state store", "", "```", json.dumps(store, indent=1)[:1500], "```", ""]


def _training_section(tr: dict, metrics: list[dict], plots: dict) -> list[str]:
    """acc_k per draft step (train, held-out, conditional), the replayed round tau, the plots and the scaling table."""
    ev, trs = tr.get("eval") or {}, tr.get("train") or {}
    K = len(ev.get("acc_k", trs.get("acc_k", [])))
    L = ["## Training", "", f"- optimizer steps: {tr.get('step')}, draft vocab coverage of trainable tokens: "
         f"{_fmt(tr.get('vocab_coverage'))}", "",
         "| | " + " | ".join(f"step {k}" for k in range(K)) + " |", "|---|" + "---|" * K]
    for name, d in (("train acc_k", trs.get("acc_k")), ("held-out acc_k", ev.get("acc_k")),
                    ("held-out acc_k given steps <k right", ev.get("cond_acc_k"))):
        if d:
            L.append(f"| {name} | " + " | ".join(_fmt(x) for x in d) + " |")
    L += ["", f"- held-out frequency baseline acc_0 (always the most common draft token): "
          f"{_fmt(ev.get('baseline_acc_0'))}; predicted chain acceptance tau_est: {_fmt(ev.get('tau_est'), 2)}", ""]
    if ev.get("round_tau_by_chain"):
        L += ["- greedy decoding of the held-out replies, replayed round by round from the eval forward "
              "(train/metrics.round_counts; what a chain-j bench on this data measures): "
              + ", ".join(f"chain-{j + 1} {t:.2f}" for j, t in enumerate(ev["round_tau_by_chain"]))
              + ". tau_est averages over every position, so it counts easy stretches once per token where "
              "decoding spends one round on several of them.", ""]
    if ev.get("round_tau_first_by_chain"):
        L += ["- the same replay over each held-out sample's first reply only (the bench decodes first turns; "
              "later turns, with earlier replies in context, accept more): "
              + ", ".join(f"chain-{j + 1} {t:.2f}" for j, t in enumerate(ev["round_tau_first_by_chain"])), ""]
    for key in ("loss", "acc_k"):
        if key in plots:
            L.append(f"![{key}]({plots[key]})")
    L.append("")
    return L + _scaling_table(metrics, plots)


def _scaling_table(metrics: list[dict], plots: dict) -> list[str]:
    scaled = [m for m in metrics if m.get("split") == "eval" and m.get("tokens_seen")]
    if not scaled:
        return []
    L = ["### Scaling: held-out accuracy against training tokens", "",
         "| training tokens seen | step | held-out acc_0 | held-out acc_1 | tau_est |", "|---|---|---|---|---|"]
    L += [f"| {m['tokens_seen']:,} | {m['step']} | {_fmt(m['acc_k'][0])} | "
          f"{_fmt(m['acc_k'][1]) if len(m['acc_k']) > 1 else '-'} | {_fmt(m['tau_est'], 2)} |" for m in scaled]
    return L + ["", "Still rising at the right edge means more data or more steps would still help.", "",
                f"![scaling]({plots['scaling']})", ""]


def _lossless_cell(ll: dict | None) -> str:
    if not ll:
        return "-"
    where = (f"fp32 rerun of {ll['turns']} turns" if ll.get("rerun")
             else f"{ll.get('dtype', 'bench dtype')}, {ll['turns']} turns")
    return f"{'yes' if ll['held'] else 'NO'} ({where})"


def _agreement_cell(a: dict | None) -> str:
    if not a:
        return "-"
    return (f"{a['dtype']}: {a['identical_turns']}/{a['turns']} turns identical, mean identical prefix "
            f"{a['mean_prefix_tokens']:.1f} tokens ({a['mean_prefix_share']:.0%})")


def _method_rows(name: str, r: dict) -> list[str]:
    """One bench's rows of the methods table: tau with its interval, speed, and both greedy checks."""
    rows = []
    for m, v in r["methods"].items():
        ll = (r.get("lossless") or {}).get(m) if m != "plain" else None
        ci = v.get("tau_ci95") if m != "plain" else None
        tau = _fmt(v.get("tau"), 2) + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
        agreement = _agreement_cell((r.get("agreement") or {}).get(m))
        rows.append(f"| {name} | {m} | {tau} | {_fmt(v.get('tokens_per_s'), 1)} | "
                    f"{_fmt(v.get('speedup'), 2)} | {_lossless_cell(ll)} | {agreement} |")
    return rows


def _timing_rows(bench: dict, stage_s: float | None) -> list[str]:
    """Each bench's start-up phases and decoding share, and their sums for the run's bench stage."""
    rows = []
    for name, r in bench.items():
        sec = r.get("seconds")
        if sec:
            share = sec["decode"] / max(sec["total"], 1e-9)
            rows.append(f"| {name} | {sec['load']:.1f} | {sec['warmup']:.1f} | {sec['decode']:.1f} | "
                        f"{sec['lossless_check']:.1f} | {sec['total']:.1f} | {share:.0%} |")
    secs = [r["seconds"] for r in bench.values() if r.get("seconds")]
    if len(secs) > 1 or (secs and stage_s):
        # the bench stage is one process: its benches share the target, runner and compiled steps; its share of
        # decoding is the start-up measure (wall: the stage's own clock when the run recorded it)
        wall = stage_s or sum(x["total"] for x in secs)
        dec = sum(x["decode"] for x in secs)
        load, warmup = sum(x["load"] for x in secs), sum(x["warmup"] for x in secs)
        check = sum(x["lossless_check"] for x in secs)
        rows.append(f"| all benches (the bench stage, one process) | {load:.1f} | {warmup:.1f} | {dec:.1f} | "
                    f"{check:.1f} | {wall:.1f} | {dec / max(wall, 1e-9):.0%} |")
    return rows


def _bench_section(bench: dict, stage_s: float | None, plots: dict) -> list[str]:
    L = ["## Speculative decoding (held-out prompts, same run, greedy checks at temperature 0)", "",
         "Lossless: speculative output equal to plain greedy token for token, checked in fp32 (a bf16 bench "
         "reruns its first turns in fp32). Agreement: the same comparison in the bench's own dtype, where "
         "multi-token verification rounds differently from one-token steps, so a lossless decoder can still "
         "drift after a near-tie.", "",
         "tau's 95% interval bootstraps over the bench's prompts (per-prompt tau spreads widely).", "",
         "| benchmark | method | tau (95% interval) | tokens/s | speedup vs plain | lossless | agreement with plain "
         "greedy |",
         "|---|---|---|---|---|---|---|"]
    for name, r in bench.items():
        L += _method_rows(name, r)
    timing = _timing_rows(bench, stage_s)
    if timing:
        L += ["", "| benchmark | load s | compile + warm-up s | timed decoding s | lossless check s | total s | "
              "decoding share |", "|---|---|---|---|---|---|---|"] + timing
    if "acceptance" in plots:
        L += ["", f"![acceptance by draft position]({plots['acceptance']})"]
    return L + [""]


def _export_section(ex: dict) -> list[str]:
    """Where the drafter is, and the serve commands of its README (from its SGLang section on)."""
    if not ex:
        return []
    readme = Path(ex["path"]) / "README.md"
    L = ["## Export", "", f"The drafter is at `{ex['path']}` (config.json + model.safetensors).", ""]
    if readme.exists():
        text = readme.read_text()
        warning = next((ln for ln in text.splitlines() if ln.startswith("**Warning:**")), None)
        L += ([warning, ""] if warning else []) + [text[text.find("## SGLang"):].replace("## ", "### ")]
    return L


def _bench_line(name: str, r: dict) -> str | None:
    """The summary's line for one bench: the EAGLE method's tau against prompt lookup, speedup and checks."""
    by = r["methods"]
    eagle = next((m for m in by if is_drafter(m)), None)
    if not eagle:
        return None
    ag = (r.get("agreement") or {}).get(eagle)
    return (f"{name}: tau {by[eagle]['tau']:.2f} (prompt lookup {by.get('lookup', {}).get('tau', 0):.2f}, "
            f"no drafter 1.00), speedup {_fmt(by[eagle].get('speedup'), 2)}x on {r.get('device')}, "
            f"lossless {_lossless_cell((r.get('lossless') or {}).get(eagle))}"
            + (f", {ag['dtype']} agreement {ag['identical_turns']}/{ag['turns']} turns" if ag else "")
            + _prompts_note(r, by[eagle]))


def _summary(run: Path, cfg, c: dict, store: dict | None, ev: dict, bench: dict, ex: dict) -> str:
    S = ["", "=" * 72, f"eyas run ({cfg.preset}) finished: {run}",
         f"  data: {c.get('kept')} conversations, {c.get('trainable_tokens')} trainable tokens"
         + (f", store {store.get('bytes_per_token', '?')} B/token" if store else ""),
         f"  held-out acc_k: {' / '.join(_fmt(x, 2) for x in ev.get('acc_k', []))} "
         f"(frequency baseline {_fmt(ev.get('baseline_acc_0'), 2)})"]
    S += [f"  {line}" for line in (_bench_line(name, r) for name, r in bench.items()) if line is not None]
    if ex:
        S.append(f"  export: {ex['path']}  (serve commands in {run / 'report.md'})")
        readme = Path(ex["path"]) / "README.md"
        if readme.exists() and "**Warning:**" in (text := readme.read_text()):
            S.append("  export warning: " + text.split("**Warning:**", 1)[1].split("\n", 1)[0].strip())
    S.append("=" * 72)
    return "\n".join(S)
