"""RUN/report.md and its plots, built only from what the stages wrote (no number is typed in).

The report opens with its verdict: which drafter setting to serve, its measured speed against plain decoding and
prompt lookup on every prompt set, where a baseline wins, the serve commands, and what went wrong in the run."""

from __future__ import annotations

import json
import re
from pathlib import Path

CUT_WARN_SHARE = 0.2
"""Warn when at least this share of the regenerated replies stopped at prepare.max_new_tokens: the drafter then
learns from replies cut short."""
NO_GAIN = 1.05
"""A drafter setting below this speedup over plain decoding is said to gain nothing."""
SET_WORDS = {"sharegpt-heldout": "held-out ShareGPT", "heldout": "held-out conversations of the run's data",
             "long": "long prompts", "humaneval": "HumanEval"}
"""How the verdict names a prompt set (the bench file's name without its method); others go by that name."""
BASELINE_WORDS = {"plain": "plain decoding", "lookup": "prompt lookup"}
COUNT_WORDS = {
    "sent_to_regeneration": "conversations sent to regeneration",
    "self_prompts_done": "prompts the target wrote itself",
    "regenerated_turns": "replies regenerated",
    "replies_cut_at_max_new_tokens": "replies cut at the reply length limit (prepare.max_new_tokens)",
    "replies_cut_at_max_len": "replies cut where the conversation reached its token budget (prepare.max_len)",
    "empty_replies": "empty replies (not trained on)",
    "generated_tokens": "tokens generated",
    "generation_tokens_per_s": "generation speed (tokens/s)",
    "self_prompts_written": "prompts the target wrote",
    "self_prompts_cut": "of them cut before their end",
    "bytes_per_token": "bytes per token",
    "loss_tokens": "trainable tokens",
    "aux_layer_ids": "target layers captured (hidden_states indices)",
}
"""The words a stage's counter is shown with; a counter not listed shows its name with spaces."""


def _words(key: str) -> str:
    return COUNT_WORDS.get(key, key.replace("_", " "))


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


def _fmt(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def is_drafter(method: str) -> bool:
    """A bench method row that a drafter ran ("eagle-chain", "eagle-tree", "dflash"), not a baseline."""
    return method.startswith("eagle") or method == "dflash"


def _predicted(ev: dict) -> list[float]:
    """The one predicted tau the report shows, by chain length 1..K: greedy decoding of each held-out sample's
    first reply replayed round by round from the eval forward (the turns a bench decodes)."""
    return ev.get("round_tau_first_by_chain") or []


# ---- plots ------------------------------------------------------------------------------------------------------

def _style(i: int) -> dict:
    """Line i's colour, dash and marker, each cycling at its own period: no two of the first 140 lines look alike."""
    return dict(color=f"C{i % 10}", linestyle=("-", "--", ":", "-.")[i % 4], marker="os^Dv<>"[i % 7], ms=4)


def _legend_outside(ax) -> None:
    """The legend right of the axes, where it covers no mark (_save widens the figure to hold it)."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


def _save(plt, fig, path: Path) -> str:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f"plots/{path.name}"


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
        ax.set_xlabel("optimizer step"), ax.set_ylabel("training loss"), ax.legend(), ax.grid(alpha=0.3)
        ax.set_title("training loss")
        made["loss"] = _save(plt, fig, out / "loss.png")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in range(len(train[-1]["acc_k"])):
            ax.plot([m["step"] for m in train], [m["acc_k"][k] for m in train], label=f"draft step {k}",
                    markevery=max(1, len(train) // 10), **_style(k))
        ax.set_xlabel("optimizer step"), ax.set_ylabel("accuracy (train)"), ax.grid(alpha=0.3)
        ax.set_title("how often the drafter's top token is the target's, by draft step")
        _legend_outside(ax)
        made["acc_k"] = _save(plt, fig, out / "acc_k.png")
    scaled = [m for m in evals if m.get("tokens_seen")]
    if scaled:
        made["scaling"] = _scaling_plot(plt, out / "scaling.png", scaled, bench)
    if bench:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        i = 0
        for name, r in bench.items():
            for m, v in r["methods"].items():
                acc = v.get("acceptance_by_position") or []
                if m != "plain" and acc:
                    ax.plot(range(1, len(acc) + 1), acc, label=f"{name}: {v.get('label', m)}", **_style(i))
                    i += 1
        ax.set_xlabel("draft position"), ax.set_ylabel("acceptance rate"), ax.set_ylim(0, 1), ax.grid(alpha=0.3)
        ax.set_title("acceptance by draft position, every bench")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if i:
            _legend_outside(ax)
        made["acceptance"] = _save(plt, fig, out / "acceptance.png")
    return made


def _scaling_plot(plt, path: Path, evals: list[dict], bench: dict) -> str:
    """Held-out accuracy (top panel) and tau (bottom: predicted from held-out replay, and each bench's measured tau
    of the final drafter) against training tokens seen: whether more data or more steps would still help."""
    x = [m["tokens_seen"] for m in evals]
    fig, (acc, tau) = plt.subplots(2, 1, figsize=(6, 5.5), sharex=True)
    for k in range(len(evals[-1]["acc_k"])):
        acc.plot(x, [m["acc_k"][k] for m in evals], label=f"draft step {k}", **_style(k))
    acc.set_ylabel("held-out accuracy"), acc.grid(alpha=0.3), _legend_outside(acc)
    acc.set_title("held-out accuracy and tau against training tokens")
    pred = [(t, p[-1]) for t, m in zip(x, evals) if (p := _predicted(m))]
    i = 0
    if pred:
        chain = len(_predicted(evals[-1]))
        tau.plot(*zip(*pred), label=f"predicted from held-out replay (chain of {chain})", **_style(i))
        i += 1
    for name, r in bench.items():
        for m, v in r.get("methods", {}).items():
            if is_drafter(m) and v.get("tau"):
                st = _style(i)
                tau.plot([x[-1]], [v["tau"]], linestyle="none", marker="*", ms=11, color=st["color"],
                         label=f"measured: {name}, {v.get('label', m)}")
                i += 1
    tau.set_xscale("log"), tau.set_xlabel("training tokens seen"), tau.set_ylabel("tau (tokens per target forward)")
    tau.grid(alpha=0.3)
    if i:
        _legend_outside(tau)
    return _save(plt, fig, path)


# ---- the verdict ------------------------------------------------------------------------------------------------

def _prompt_set(bench_name: str) -> str:
    """The prompt set of an `eyas run` bench: its file name without the method ("long-chain5" -> "long")."""
    return re.sub(r"-(chain\d*|tree|dflash\d*)$", "", bench_name)


def _set_words(name: str) -> str:
    return SET_WORDS.get(name, name)


def _by_set(bench: dict) -> dict[str, dict]:
    """{prompt set: {"records", "lookup": its fastest prompt lookup row or None, "drafters": {setting label: row}}}
    over the rows with a measured speedup; a row carries its method, bench and decode settings."""
    sets = {}
    for name, r in sorted(bench.items()):
        s = sets.setdefault(_prompt_set(name), {"records": r.get("records"), "lookup": None, "drafters": {}})
        for m, v in r["methods"].items():
            if v.get("speedup") is None:
                continue
            if m == "lookup" and (s["lookup"] is None or v["speedup"] > s["lookup"]["speedup"]):
                s["lookup"] = v
            elif is_drafter(m):
                label = v.get("label") or m
                if label not in s["drafters"] or v["speedup"] > s["drafters"][label]["speedup"]:
                    s["drafters"][label] = {**v, "method": m, "bench": name,
                                            "spec": (r.get("config") or {}).get("spec") or {}}
    return sets


def _fastest(s: dict) -> tuple[str, float]:
    """The fastest method of a prompt set: (a drafter setting's label, "prompt lookup" or "plain decoding", speedup)."""
    runs = [(label, d["speedup"]) for label, d in s["drafters"].items()]
    runs += [("prompt lookup", s["lookup"]["speedup"])] if s["lookup"] else []
    return max(runs + [("plain decoding", 1.0)], key=lambda t: t[1])


def verdict(bench: dict, ev: dict) -> dict | None:
    """What to serve, from the benches: {"headline", "table", "notes"} (markdown), or None without a drafter row
    of measured speed. The setting served is the fastest drafter setting on the prompt set with the most drafter
    settings measured (ties: the held-out set); a baseline faster there is served instead."""
    sets = _by_set(bench)
    measured = [n for n, s in sets.items() if s["drafters"]]
    if not measured:
        return None
    main = max(measured, key=lambda n: (len(sets[n]["drafters"]), "heldout" in n))
    s = sets[main]
    label, d = max(((lb, r) for lb, r in s["drafters"].items()), key=lambda t: t[1]["speedup"])
    sp, lk = d["speedup"], s["lookup"]["speedup"] if s["lookup"] else None
    winner = _fastest(s)[0]
    where = f"on {_set_words(main)}" + (" (the prompt set with the most drafter settings measured)"
                                         if len(sets) > 1 else "")
    if winner == label:
        head = (f"Serve the drafter as **{label}**: {where} it decodes {sp:.2f}x as fast as plain decoding"
                + (f" and {sp / lk:.2f}x as fast as prompt lookup" if lk else "") + f" (measured tau {d['tau']:.2f}).")
    elif winner == "prompt lookup":
        head = (f"Serve **prompt lookup**, not the drafter: {where} prompt lookup is faster ({lk:.2f}x plain "
                f"decoding) than the best drafter setting, {label} ({sp:.2f}x).")
    else:
        head = (f"Serve **plain decoding**: {where} every speculative method is slower than plain decoding (the best "
                f"drafter setting, {label}: {sp:.2f}x).")
    order = [main] + [n for n in sets if n != main]
    labels = [label] + [lb for n in order for lb in sets[n]["drafters"] if lb != label]
    labels = list(dict.fromkeys(labels))
    table = ["| prompt set | prompts | " + " | ".join(labels) + " | prompt lookup | fastest | "
             f"{label} against prompt lookup |", "|---|---|" + "---|" * (len(labels) + 3)]
    notes = []
    for n in order:
        st, (best, top) = sets[n], _fastest(sets[n])
        if not st["drafters"] and not st["lookup"]:  # no speed measured on this set (tokens/s missing)
            best = "not measured"
        cell = lambda r, name: "-" if r is None else (  # noqa: E731
            (f"**{r['speedup']:.2f}x**" if name == best else f"{r['speedup']:.2f}x") + f" (tau {r['tau']:.2f})")
        mine, lkn = st["drafters"].get(label), st["lookup"]
        ratio = f"{mine['speedup'] / lkn['speedup']:.2f}x" if mine and lkn else "-"
        table.append(f"| {_set_words(n)} | {_fmt(st['records'])} | "
                     + " | ".join(cell(st["drafters"].get(lb), lb) for lb in labels)
                     + f" | {cell(lkn, 'prompt lookup')} | {best} | {ratio} |")
        if best != "not measured":
            notes += _set_notes(n, st, label, best, top, skip_winner=n == main and winner != label)
    return {"headline": head, "table": table, "notes": notes, "served": label if winner == label else None,
            "row": d, "predicted": _prediction(d, ev, main)}


def _set_notes(name: str, s: dict, served: str, best: str, top: float, *, skip_winner: bool) -> list[str]:
    """Plain words for a prompt set where the served setting is not the fastest, and for drafter settings that
    gain nothing over plain decoding there."""
    where, mine = _set_words(name), s["drafters"].get(served)
    notes = []
    if best == "prompt lookup" and not skip_winner:
        notes.append(f"On {where} prompt lookup is faster ({top:.2f}x vs {mine['speedup']:.2f}x): serve prompt lookup "
                     f"for such prompts, or accept {mine['speedup'] / top:.2f}x of its speed with the drafter."
                     if mine else f"On {where} prompt lookup is the fastest method measured ({top:.2f}x).")
    elif best == "plain decoding" and not skip_winner:
        notes.append(f"On {where} plain decoding is faster than every speculative method measured: serve without "
                     f"speculation for such prompts.")
    elif best not in (served, "prompt lookup", "plain decoding") and mine:
        notes.append(f"On {where} {best} is faster ({top:.2f}x vs {mine['speedup']:.2f}x for {served}).")
    for label, r in s["drafters"].items():
        if r["speedup"] < NO_GAIN and best != "plain decoding":
            notes.append(f"On {where} {label} " + ("gains nothing over" if r["speedup"] >= 1 else "is slower than")
                         + f" plain decoding ({r['speedup']:.2f}x).")
    return notes


def _prediction(row: dict, ev: dict, main: str) -> str | None:
    """The training's predicted tau beside the served chain's measured one (chains only: the replay is of chains)."""
    k, pred = row["spec"].get("k"), _predicted(ev)
    if row["method"] != "eagle-chain" or not k or len(pred) < k:
        return None
    return (f"Predicted from held-out replay before the bench: tau {pred[k - 1]:.2f} for a chain of {k} drafts "
            f"(measured on {_set_words(main)}: {row['tau']:.2f}).")


def _warnings(run: Path, state: dict, data: dict) -> list[str]:
    """Failed background warm-ups (their log's last line) and a large share of regenerated replies cut short."""
    out = []
    for key, name, what, who, marker in (
            ("train_prewarm", "train-prewarm", "training's compile (during prepare)", "training", "startup"),
            ("prewarm", "prewarm", "the bench's compile (during training)", "the bench", "benches")):
        rec = state.get(key) or {}
        if "returncode" not in rec:
            continue
        rc = rec["returncode"]
        if rc == 0 and marker in rec:
            if rec.get("drafter_matched") is False:
                out.append(f"The background warm-up of {what} compiled for another drafter configuration than the "
                           f"one trained, so {who} compiled its graphs itself.")
            continue
        how = (f"failed (exit status {rc})" if rc and rc > 0 else "exited without a result" if rc == 0
               else "was stopped before it finished")
        log = run / "logs" / f"{name}.log"
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
        out.append(f"The background warm-up of {what} {how}, so {who} compiled its graphs itself and the run took "
                   f"longer" + (f"; logs/{name}.log ends: `{lines[-1]}`" if lines else "") + ".")
    turns, cut = data.get("regenerated_turns"), data.get("replies_cut_at_max_new_tokens")
    if turns and cut is not None and cut / turns >= CUT_WARN_SHARE:
        limit = (_prepare_config(run).get("regen") or {}).get("max_new_tokens")
        out.append(f"{cut / turns:.0%} of the regenerated replies ({cut} of {turns}) stopped at the reply length "
                   f"limit (prepare.max_new_tokens" + (f" = {limit}" if limit else "") + ") before their end: the "
                   "drafter learned from replies cut short. Raise it with --set prepare.max_new_tokens=N (a reasoning "
                   "model's replies need thousands of tokens).")
    return out


def _prepare_config(run: Path) -> dict:
    path = run / "prepared" / "manifest.json"
    try:
        return json.loads(path.read_text()).get("config") or {}
    except (OSError, ValueError):
        return {}


def _verdict_section(run: Path, v: dict | None, warnings: list[str], export: dict) -> list[str]:
    L = ["## Verdict", ""]
    if v is None:
        L += ["No bench measured a drafter's speed against plain decoding, so there is nothing to recommend yet.", ""]
    else:
        L += [v["headline"], "", "Speed against plain decoding on each prompt set (measured tau in brackets; the "
              "fastest in bold):", ""] + v["table"] + [""]
        L += [f"- {n}" for n in v["notes"]] + ([""] if v["notes"] else [])
        L += [v["predicted"], ""] if v["predicted"] else []
    if warnings:
        L += ["### Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    return L + _serve_lines(export, v)


def _serve_lines(ex: dict, v: dict | None) -> list[str]:
    """The export README's serve commands (from its SGLang section on), with its engine warning and, when the
    setting chosen differs from the one they serve, the flags that change."""
    readme = Path(ex["path"]) / "README.md" if ex else None
    if readme is None or not readme.exists():
        return []
    text = readme.read_text()
    L = ["### Serve", "", f"The exported drafter, `{ex['path']}`"
         + (", served as chosen above:" if v and v["served"] else ", should you serve it:"), ""]
    spec = v["row"]["spec"] if v and v["served"] else {}
    if v and v["served"] and v["row"]["method"] == "eagle-chain" and spec.get("k") and \
            f"--speculative-num-steps {spec['k']} " not in text:
        L += [f"The commands below draft another chain length; for {v['served']} set `--speculative-num-steps "
              f"{spec['k']} --speculative-num-draft-tokens {spec['k'] + 1}` (SGLang) or `\"num_speculative_tokens\": "
              f"{spec['k']}` (vLLM).", ""]
    elif v and v["served"] and v["row"]["method"] == "eagle-tree" and spec.get("top_k"):
        L += [f"The commands below draft a chain; for {v['served']} set SGLang's `--speculative-num-steps "
              f"{spec['depth']} --speculative-eagle-topk {spec['top_k']} --speculative-num-draft-tokens "
              f"{spec['total_tokens']}`.", ""]
    warning = next((ln for ln in text.splitlines() if ln.startswith("**Warning:**")), None)
    return L + ([warning, ""] if warning else []) + [text[text.find("## SGLang"):].replace("## ", "#### ")]


# ---- the report -------------------------------------------------------------------------------------------------

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
    v, warnings = verdict(bench, train.get("eval") or {}), _warnings(run, state, data)
    L = _header(run, state, cfg) + _verdict_section(run, v, warnings, export)
    L += _stages_table(stages, state.get("plan")) + _data_section(data) + _store_section(store)
    L += _training_section(train, metrics, plots)
    L += _bench_section(bench, stages.get("bench", {}).get("seconds"), plots)
    L += _export_section(export)
    (run / "report.md").write_text("\n".join(L) + "\n")
    return _summary(run, cfg, data, store, train.get("eval") or {}, bench, export, v, warnings)


def _header(run: Path, state: dict, cfg) -> list[str]:
    L = [f"# eyas run report: {cfg.preset}", "",
         f"Target `{cfg.target}`, data `{cfg.data}`, run directory `{run}`, started {state.get('created')}.", ""]
    if cfg.preset == "cpu-demo":
        L += ["This is the CPU demonstration preset: small data and short training. For a real drafter run "
              "`eyas run --preset gpu` on a CUDA machine.", ""]
    return L


def plan_changes(plan: dict) -> str:
    """What a sized run's plan (run.json `plan`, eyas.sizing) changed, as `KEY RECIPE -> SIZED, ...`, or "the recipe
    as written"."""
    return (", ".join(f"{k} {plan['recipe'][k]} -> {v}" for k, v in plan["overrides"].items())
            or "the recipe as written")


def _stages_table(stages: dict, plan: dict | None) -> list[str]:
    """Each stage's seconds; with a plan (a run sized to its budget, eyas.sizing), what it was sized to and the
    estimate beside them."""
    if not plan:
        L = ["## Stages", "", "| stage | seconds |", "|---|---|"]
        L += [f"| {s} | {v.get('seconds', 0):.0f} |" for s, v in stages.items()]
        total = sum(v.get("seconds", 0) for v in stages.values())
        return L + [f"| total | {total:.0f} |", ""]
    est = plan["estimate_s"]
    L = ["## Stages", "", f"Sized to {plan['budget_s'] / 60:g} minutes on this machine after "
         f"{plan['rates']['seconds']:.0f} s of measuring it: {plan_changes(plan)}. The estimate counts every "
         "regenerated reply at its full length.", "",
         "| stage | seconds | estimated |", "|---|---|---|"]
    L += [f"| {s} | {v.get('seconds', 0):.0f} | {est[s]:.0f} |" if s in est else
          f"| {s} | {v.get('seconds', 0):.0f} | |" for s, v in stages.items()]
    total = sum(v.get("seconds", 0) for v in stages.values())
    return L + [f"| total | {total:.0f} | {sum(est.values()):.0f} |", ""]


def _data_section(c: dict) -> list[str]:
    """The prepare stage's counts in words; any count beyond the plain ones is regeneration's."""
    plain = ("read", "kept", "heldout", "tokens", "trainable_tokens", "truncated", "skipped", "dropped",
             "conversations")
    L = ["## Data", "", f"- conversations read: {c.get('read')}, kept for training: {c.get('kept')}"
         + (f" samples of {c['conversations']} conversations" if "conversations" in c else "")
         + f", held out for bench: {c.get('heldout')}",
         f"- tokens: {c.get('tokens')}, trainable (assistant) tokens: {c.get('trainable_tokens')}, "
         f"truncated conversations: {c.get('truncated')}"]
    for what in ("skipped", "dropped"):
        for reason, n in sorted((c.get(what) or {}).items()):
            L.append(f"- {what}: {reason}: {n}")
    regen = {k: v for k, v in c.items() if k not in plain}
    if regen:
        L.append("- regeneration: " + ", ".join(f"{_words(k)}: {_fmt(v, 1)}" for k, v in regen.items()))
    return L + [""]


def _store_section(store: dict | None) -> list[str]:
    if not store:
        return []
    return ["## Hidden-state store", ""] + [f"- {_words(k)}: {_fmt(v, 2)}" for k, v in store.items()] + [""]


def _training_section(tr: dict, metrics: list[dict], plots: dict) -> list[str]:
    """Accuracy per draft step (train, held-out, given the earlier steps), the predicted tau, the plots and the
    scaling table."""
    ev, trs = tr.get("eval") or {}, tr.get("train") or {}
    K = len(ev.get("acc_k", trs.get("acc_k", [])))
    L = ["## Training", "", f"- optimizer steps: {tr.get('step')}, draft vocab coverage of trainable tokens: "
         f"{_fmt(tr.get('vocab_coverage'))}", "",
         "Accuracy: how often the drafter's top token is the target's, by draft step.", "",
         "| | " + " | ".join(f"step {k}" for k in range(K)) + " |", "|---|" + "---|" * K]
    for name, d in (("train accuracy", trs.get("acc_k")), ("held-out accuracy", ev.get("acc_k")),
                    ("held-out accuracy when the earlier steps were right", ev.get("cond_acc_k"))):
        if d:
            L.append(f"| {name} | " + " | ".join(_fmt(x) for x in d) + " |")
    L += ["", f"- held-out accuracy of always drafting the most common token (the floor): "
          f"{_fmt(ev.get('baseline_acc_0'))}", ""]
    if pred := _predicted(ev):
        L += ["- predicted tau from held-out replay: greedy decoding replayed round by round over each held-out "
              "sample's first reply only (the turns a bench decodes), by chain length: "
              + ", ".join(f"{j + 1} draft{'s' * (j > 0)} {t:.2f}" for j, t in enumerate(pred)), ""]
    for key, alt in (("loss", "training loss"), ("acc_k", "accuracy by draft step")):
        if key in plots:
            L.append(f"![{alt}]({plots[key]})")
    L.append("")
    return L + _scaling_table(metrics, plots)


def _scaling_table(metrics: list[dict], plots: dict) -> list[str]:
    scaled = [m for m in metrics if m.get("split") == "eval" and m.get("tokens_seen")]
    if not scaled:
        return []
    chain = len(_predicted(scaled[-1]))
    L = ["### Scaling: held-out accuracy against training tokens", "",
         "| training tokens seen | step | held-out accuracy, step 0 | held-out accuracy, step 1 | predicted tau "
         f"from held-out replay{f' (chain of {chain})' if chain else ''} |", "|---|---|---|---|---|"]
    L += [f"| {m['tokens_seen']:,} | {m['step']} | {_fmt(m['acc_k'][0])} | "
          f"{_fmt(m['acc_k'][1]) if len(m['acc_k']) > 1 else '-'} | "
          f"{_fmt(_predicted(m)[-1], 2) if _predicted(m) else '-'} |" for m in scaled]
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
    """Where the drafter is, with its README's engine warning (its serve commands are in the verdict)."""
    if not ex:
        return []
    readme = Path(ex["path"]) / "README.md"
    L = ["## Export", "", f"The drafter is at `{ex['path']}` (config.json + model.safetensors); its serve commands "
         "are in the verdict above and in its README.md.", ""]
    if readme.exists():
        warning = next((ln for ln in readme.read_text().splitlines() if ln.startswith("**Warning:**")), None)
        L += [warning, ""] if warning else []
    return L


def _bench_line(name: str, r: dict) -> str | None:
    """The summary's line for one bench: the drafter's tau against prompt lookup, speedup and checks."""
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


def _summary(run: Path, cfg, c: dict, store: dict | None, ev: dict, bench: dict, ex: dict, v: dict | None,
             warnings: list[str]) -> str:
    S = ["", "=" * 72, f"eyas run ({cfg.preset}) finished: {run}"]
    if v is not None:
        S += [f"  verdict: {v['headline'].replace('**', '')}"] + [f"  note: {n}" for n in v["notes"]]
    S += [f"  warning: {w}" for w in warnings]
    S += [f"  data: {c.get('kept')} conversations, {c.get('trainable_tokens')} trainable tokens"
          + (f", store {store.get('bytes_per_token', '?')} B/token" if store else ""),
          f"  held-out accuracy by draft step: {' / '.join(_fmt(x, 2) for x in ev.get('acc_k', []))} "
          f"(most common token {_fmt(ev.get('baseline_acc_0'), 2)})"]
    S += [f"  {line}" for line in (_bench_line(name, r) for name, r in bench.items()) if line is not None]
    if ex:
        S.append(f"  export: {ex['path']}  (serve commands in {run / 'report.md'})")
        readme = Path(ex["path"]) / "README.md"
        if readme.exists() and "**Warning:**" in (text := readme.read_text()):
            S.append("  export warning: " + text.split("**Warning:**", 1)[1].split("\n", 1)[0].strip())
    S.append("=" * 72)
    return "\n".join(S)
