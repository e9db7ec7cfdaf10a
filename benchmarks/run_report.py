"""Summarise an `eyas run` directory as a BENCHMARKS.md section (benchmarks.record's header: date, machine,
commit, and the run's own command): stage wall times, data, held-out acc_k, and tau / tokens/s / speedup of every
bench with its baselines, all read from what the run measured.

    python -m benchmarks.run_report RUN --command "eyas run --preset gpu ..." [--md OUT.md] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import record
from eyas.report import plan_changes


def section(run: Path, command: str, title: str | None = None) -> str:
    """The run's section; `command` is the `eyas run` command that made RUN; title: the section's (default: the
    preset's name)."""
    state = json.loads((run / "run.json").read_text())
    st = state["stages"]
    knobs = state["identity"].get("knobs") or state["identity"].get("recipe") or {}
    lines = []
    total = sum(v.get("seconds", 0) for v in st.values())
    est = (state.get("plan") or {}).get("estimate_s") or {}
    lines += ["| stage | wall s | estimated s | done |", "|---|---|---|---|"]
    lines += [f"| {name} | {v.get('seconds', 0):.0f} | {est[name]:.0f} | {v.get('done', False)} |" if name in est
              else f"| {name} | {v.get('seconds', 0):.0f} | | {v.get('done', False)} |" for name, v in st.items()]
    lines += [f"| **all stages** | **{total:.0f}** | {sum(est.values()):.0f} | |" if est
              else f"| **all stages** | **{total:.0f}** | | |"]
    if wall := state.get("wall_seconds_this_invocation"):
        lines.append(f"| whole invocation (load, sizing, report) | {wall:.0f} | | |")
    lines.append("")
    if plan := state.get("plan"):
        r = plan["rates"]
        lines.append(f"- sized to {plan['budget_s'] / 60:g} minutes after {r['seconds']:.0f} s of measuring: "
                     f"{plan_changes(plan)}; "
                     f"measured: regeneration step {r['decode_s_per_step'] * 1e3:.0f} ms, capture "
                     f"{1 / r['capture_s_per_token']:,.0f} tok/s, training {1 / r['train_s_per_token']:,.0f} tok/s, "
                     f"batch-1 decoding {1 / r['bench_s_per_token']:.1f} tok/s")
    prep = st.get("prepare", {}).get("summary")
    if prep:
        lines.append(f"- data: kept {prep.get('kept')} conversations, {prep.get('tokens')} tokens "
                     f"({prep.get('trainable_tokens')} trainable); regenerated {prep.get('generated_tokens')} tokens "
                     f"at {prep.get('generation_tokens_per_s')} tok/s")
    tr = st.get("train", {}).get("summary")
    if tr:
        ev = tr.get("eval") or {}
        acc = " / ".join(f"{a:.3f}" for a in ev.get("acc_k", []))
        lines.append(f"- train: {tr.get('step')} steps; held-out acc_k {acc}; tau_est {ev.get('tau_est', 0):.2f}; "
                     f"replayed tau by chain {' / '.join(f'{t:.2f}' for t in ev.get('round_tau_by_chain', []))} "
                     f"(first replies {' / '.join(f'{t:.2f}' for t in ev.get('round_tau_first_by_chain', []))}); "
                     f"draft-vocab coverage {tr.get('vocab_coverage')}")
        manifest = run / "train" / "manifest.json"
        if manifest.exists() and (su := json.loads(manifest.read_text()).get("startup")):
            lines.append(f"- train start-up: set-up {su.get('setup_s')} s, first step {su.get('first_step_s')} s "
                         f"(its compiles and the first target features)")
        if tp := state.get("train_prewarm"):
            cache = tp.get("compile_cache") or {}
            lines.append(f"- train warm-up process during prepare: {tp.get('seconds')} s, exit {tp.get('returncode')}, "
                         f"finished before train: {tp.get('finished_before_train')}, train waited "
                         f"{tp.get('waited_s')} s; its own first step {(tp.get('startup') or {}).get('first_step_s')} s "
                         f"(fx graph cache hits {cache.get('fx_graph_hits')} / misses {cache.get('fx_graph_misses')})")
        metrics = run / "train" / "metrics.jsonl"
        if metrics.exists():
            rates = [json.loads(x).get("tokens_per_s") for x in metrics.read_text().splitlines() if '"train"' in x]
            rates = [r for r in rates if r]
            if rates:
                lines.append(f"- train throughput (last step's running rate): {rates[-1]:,.0f} tok/s")
            waits = [json.loads(x).get("data_wait_s") for x in metrics.read_text().splitlines() if '"train"' in x]
            if any(w is not None for w in waits):
                lines.append(f"- input wait (data_wait_s, summed over logged steps): {sum(w or 0 for w in waits):.1f} s")
    lines.append("")
    benches = sorted((run / "bench").glob("*.json")) if (run / "bench").exists() else []
    if benches:
        lines += ["| bench | method | tau (95% interval over prompts) | tok/s | speedup vs plain | lossless turns | "
                  "acceptance by position |",
                  "|---|---|---|---|---|---|---|"]
        for p in benches:
            r = json.loads(p.read_text())
            for name, m in r["methods"].items():
                ll = (r.get("lossless") or {}).get(name)
                lossless = f"{ll['identical_turns']}/{ll['turns']}" if ll else "-"
                acc = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"][:6])
                ci = m.get("tau_ci95") if name != "plain" else None
                tau = f"{m['tau']:.2f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
                lines.append(f"| {p.stem} ({r['records']} prompts) | {name} | {tau} | {m['tokens_per_s']} | "
                             f"{m.get('speedup', 1.0)} | {lossless} | {acc} |")
        lines.append("")
        lines += warmup_lines(state, benches)
    title = title or f"eyas run ({state['identity']['preset']} preset)"
    return record.section(title, "\n".join(lines), command=command,
                          details=[f"knobs: `{json.dumps({k: v for k, v in knobs.items() if k != 'bench'})}`"])


def warmup_lines(state: dict, benches: list[Path]) -> list[str]:
    """Issue 33 goal 1's start-up numbers: each bench process's own compile + warm-up seconds and what it still
    compiled, and the warm-up process that ran during training (run.json `prewarm`)."""
    out = []
    for p in benches:
        r = json.loads(p.read_text())
        w, cache = r.get("warmup") or {}, r.get("compile_cache") or {}
        out.append(f"- {p.stem}: load {r['seconds'].get('load', 0):.1f} s, compile + warm-up "
                   f"{r['seconds'].get('warmup', 0):.1f} s (shapes {w.get('shapes')}, built here {w.get('built')}, "
                   f"late {w.get('late_shapes')}; fx graph cache hits {cache.get('fx_graph_hits')} / misses "
                   f"{cache.get('fx_graph_misses')}; saved steps {w.get('saved_steps')})")
    pre = state.get("prewarm")
    if pre:
        out.append(f"- bench warm-up process during training: {pre.get('seconds')} s, exit {pre.get('returncode')}, "
                   f"finished before bench: {pre.get('finished_before_bench')}, bench waited {pre.get('waited_s')} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--command", required=True)
    ap.add_argument("--title", help="the section's title (default: the preset's name)")
    ap.add_argument("--md", type=Path, help="write the section to this file")
    ap.add_argument("--append", type=Path, help="append the section to this file (e.g. BENCHMARKS.md)")
    a = ap.parse_args()
    text = section(a.run, a.command, a.title)
    print(text)
    if a.md:
        a.md.write_text(text)
    if a.append:
        record.append(text, a.append)


if __name__ == "__main__":
    main()
