"""The bench's report as people read it: the table printed, the JSON and the acceptance plot written beside it."""

from __future__ import annotations

import json
from pathlib import Path

from eyas.manifest import atomic_write_bytes


def divergence_line(name: str, div: list[dict]) -> str:
    """One line on where `name`'s replies first left plain's: the plain side's logprob margins there."""
    margins = [d["margin"] for d in div if d["margin"] is not None]
    ended = sum(d["plain"] is None or d["spec"] is None for d in div)
    outside = len(div) - len(margins) - ended
    line = f"{name} first differing tokens: {len(div)} turn(s)"
    if margins:
        line += (f"; plain's logprob margin over the drafted token: max {max(margins):.3f}, median "
                 f"{sorted(margins)[len(margins) // 2]:.3f} nats")
    if ended:
        line += f"; {ended} where one reply ended"
    if outside:
        line += f"; {outside} drafted token(s) outside plain's top candidates"
    return line


def write_report(report: dict, json_out: str | None, out) -> None:
    """Print the report's table to `out`; with json_out, write the report there and its acceptance plot beside it
    (the plot's path is added to `report` after the file is written)."""
    print(format_table(report), file=out)
    if json_out:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(report, indent=2) + "\n").encode())
        report["plot"] = plot_acceptance(report, path.with_suffix(".png"))


def format_table(report: dict) -> str:
    rows = [f"{'method':<14}{'tokens':>8}{'tok/s':>10}{'speedup':>9}{'tau':>7}  acceptance by position"]
    for name, m in report["methods"].items():
        acc = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"][:8])
        rows.append(f"{name:<14}{m['tokens']:>8}{m['tokens_per_s'] or 0:>10.1f}{m.get('speedup', 1.0):>9.2f}"
                    f"{m['tau']:>7.2f}  {acc}")
    if "dflash" in report["methods"]:
        rows.append(f"dflash: {report['methods']['dflash']['label']}; acceptance by position is by block slot")
    for name, ll in report.get("lossless", {}).items():
        what = f"fp32 rerun of {ll['turns']} turns" if ll.get("rerun") else f"{ll.get('dtype', 'bench')}, all {ll['turns']} turns"
        rows.append(f"{name} lossless ({what}): {'yes' if ll['held'] else 'NO'}"
                    + ("" if ll["held"] else f", {ll['identical_turns']}/{ll['turns']} turns equal plain greedy"))
    for name, a in report.get("agreement", {}).items():
        rows.append(f"{name} {a['dtype']} agreement: {a['identical_turns']}/{a['turns']} turns identical, mean identical "
                    f"prefix {a['mean_prefix_tokens']:.1f} tokens ({a['mean_prefix_share']:.0%} of the turn)")
        if a.get("divergences"):
            rows.append(divergence_line(name, a["divergences"]))
    if "seconds" in report:
        s = report["seconds"]
        share = f" ({s['decode'] / s['total']:.0%} of {s['total']:.1f} s)" if s.get("total") else ""
        cache = report.get("compile_cache")
        rows.append(f"seconds: load {s['load']:.1f}, compile+warm-up {s['warmup']:.1f}, decoding {s['decode']:.1f}{share}, "
                    f"lossless check {s['lossless_check']:.1f}"
                    + (f"; inductor cache {cache['fx_graph_hits']} hits, {cache['fx_graph_misses']} misses" if cache else ""))
    p = report.get("prompts")
    about = ""
    if p:
        kinds = ", ".join(f"{n} {k}" for k, n in p["kinds"].items())
        about = f" ({kinds + '; ' if kinds else ''}first prompt {p['tokens']['min']}-{p['tokens']['max']} tokens, " \
                f"median {p['tokens']['median']})"
    rows.append(f"{report['records']} prompts{about}, {report['turns']} turns, {report['truncated']} truncated, "
                f"device {report['device']}")
    for name, m in report["methods"].items():
        if m.get("tau_by_kind") and name != "plain":
            rows.append(f"{name} tau by kind: " + ", ".join(f"{k} {t:.2f}" for k, t in m["tau_by_kind"].items()))
    return "\n".join(rows)


def plot_acceptance(report: dict, path: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, m in report["methods"].items():
        acc = m["acceptance_by_position"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{m.get('label', name)} (tau {m['tau']:.2f})")
    longest = max((len(m["acceptance_by_position"]) for m in report["methods"].values()), default=0)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position (DFlash: block slot)" if "dflash" in report["methods"] else "draft position")
    ax.set_ylabel("fraction of rounds accepted")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    speeds = ", ".join(f"{m.get('label', n)} {m['speedup']:.2f}x" for n, m in report["methods"].items()
                       if n != "plain" and m.get("speedup"))  # the prompt set (the file's name) and the speedups
    ax.set_title(f"{path.stem}: acceptance by draft position" + (f"\nspeed against plain: {speeds}" if speeds else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
