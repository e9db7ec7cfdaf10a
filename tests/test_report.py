"""RUN/report.md and the end-of-run summary: every section, read from a run directory that has them all; the
verdict that opens it, its warnings and its plots' line styles."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from eyas.report import _style, write_report

GOLDEN = Path(__file__).parent / "support" / "golden" / "report.md"
SUMMARY = "\n".join([
    "", "=" * 72, "eyas run (cpu-demo) finished: {RUN}",
    "  verdict: Serve the drafter as eagle-3 chain of 5 drafts: on held-out ShareGPT (the prompt set with the most "
    "drafter settings measured) it decodes 1.80x as fast as plain decoding and 1.50x as fast as prompt lookup "
    "(measured tau 2.90).",
    "  note: On held-out ShareGPT eagle-3 tree (top-k 4, depth 5, 16 nodes) gains nothing over plain decoding (1.01x).",
    "  note: On long prompts prompt lookup is faster (1.45x vs 1.29x): serve prompt lookup for such prompts, or accept "
    "0.89x of its speed with the drafter.",
    "  warning: The background warm-up of the bench's compile (during training) failed (exit status 2), so the "
    "bench compiled its graphs itself and the run took longer; logs/prewarm.log ends: `Intel oneMKL FATAL ERROR: "
    "Cannot load /venv/lib/torch/lib/libtorch_cpu.so.`.",
    "  warning: 64% of the regenerated replies (64 of 100) stopped at the reply length limit "
    "(prepare.max_new_tokens = 256) before their end: the drafter learned from replies cut short. Raise it with "
    "--set prepare.max_new_tokens=N (a reasoning model's replies need thousands of tokens).",
    "  data: 120 conversations, 45678 trainable tokens, store 4104 B/token",
    "  held-out accuracy by draft step: 0.61 / 0.42 / 0.30 (most common token 0.07)",
    "  humaneval-chain5: tau 1.90 (prompt lookup 0.00, no drafter 1.00), speedup -x on cpu, lossless NO (fp32, 2 "
    "turns)",
    "  long-chain5: tau 2.41 (prompt lookup 1.31, no drafter 1.00), speedup 1.29x on cpu, lossless yes (fp32 rerun "
    "of 4 turns), bf16 agreement 3/4 turns; 2 prompts of 2100-5000 tokens (1 conversation tau 2.20, 1 document tau "
    "2.62)",
    "  sharegpt-heldout-chain5: tau 2.90 (prompt lookup 1.20, no drafter 1.00), speedup 1.80x on cpu, lossless yes "
    "(fp32, 4 turns)",
    "  sharegpt-heldout-tree: tau 3.10 (prompt lookup 1.20, no drafter 1.00), speedup 1.01x on cpu, lossless yes "
    "(fp32, 4 turns)",
    "  export: {RUN}/export  (serve commands in {RUN}/report.md)",
    "=" * 72])
CHAIN5 = {"method": "chain", "k": 5, "top_k": 4, "depth": 5, "total_tokens": 16}
TREE = {**CHAIN5, "method": "tree"}


def _method(tau: float, speedup: float | None, label: str, **kw) -> dict:
    """One method row of a bench JSON, as run_bench writes it (tokens/s from the speedup over 36.3 tokens/s)."""
    return {"label": label, "tau": tau, "tokens_per_s": None if speedup is None else round(36.3 * speedup, 2),
            "speedup": speedup, **kw}


def _bench(methods: dict, spec: dict, **kw) -> dict:
    """A bench JSON of the cpu with plain decoding and the given rows."""
    return {"records": 3, "device": "cpu", "config": {"spec": spec},
            "methods": {"plain": _method(1.0, 1.0, "plain"), **methods},
            "seconds": {"load": 0.5, "warmup": 2.0, "decode": 8.0, "lossless_check": 1.0, "total": 11.5}, **kw}


def full_run(run: Path) -> tuple[dict, SimpleNamespace]:
    """A run directory whose stages wrote every part the report reads, with a served setting that wins on one set
    and loses to prompt lookup on another, a tree that gains nothing, a failed bench warm-up and most regenerated
    replies cut at their length limit; -> (run state, run config)."""
    for d in ("train", "bench", "export", "logs", "prepared"):
        (run / d).mkdir(parents=True)
    rows = [{"split": "train", "step": s, "loss": 3.0 - s / 10, "acc_k": [0.1 * s, 0.05 * s, 0.02 * s]}
            for s in (1, 2, 3)]
    rows += [{"split": "eval", "step": s, "loss": 2.9 - s / 10, "acc_k": [0.2 * s, 0.1 * s, 0.05 * s],
              "tokens_seen": 1000 * s, "tau_est": 1.0 + s / 3, "round_tau_first_by_chain": [1.0 + s / 5, 1.1 + s / 4]}
             for s in (1, 3)]
    (run / "train" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn line\n")
    lookup = _method(1.2, 1.2, "lookup", acceptance_by_position=[0.3, 0.1])
    long = _bench({"lookup": _method(1.31, 1.45, "lookup", acceptance_by_position=[]),
                   "eagle-chain": _method(2.41, 1.29, "eagle-3 chain of 5 drafts", tau_ci95=[2.1, 2.7],
                                          acceptance_by_position=[0.8, 0.6, 0.4],
                                          tau_by_kind={"conversation": 2.2, "document": 2.62})}, CHAIN5,
                  lossless={"lookup": {"held": True, "turns": 4, "dtype": "fp32"},
                            "eagle-chain": {"held": True, "turns": 4, "rerun": True}},
                  agreement={"eagle-chain": {"dtype": "bf16", "identical_turns": 3, "turns": 4,
                                             "mean_prefix_tokens": 41.25, "mean_prefix_share": 0.83}},
                  prompts={"tokens": {"min": 2100, "median": 3000, "max": 5000},
                           "kinds": {"conversation": 1, "document": 1}})
    long.update(records=2, seconds={"load": 1.25, "warmup": 10.5, "decode": 30.0, "lossless_check": 4.0,
                                    "total": 46.0})
    held = {"eagle-chain": {"held": True, "turns": 4, "dtype": "fp32"}}
    chain = _bench({"lookup": lookup, "eagle-chain": _method(2.9, 1.8, "eagle-3 chain of 5 drafts",
                                                             acceptance_by_position=[0.9, 0.7, 0.5])},
                   CHAIN5, lossless=held)
    tree = _bench({"lookup": lookup, "eagle-tree": _method(3.1, 1.01, "eagle-3 tree (top-k 4, depth 5, 16 nodes)",
                                                           acceptance_by_position=[0.95, 0.8])},
                  TREE, lossless={"eagle-tree": held["eagle-chain"]})
    humaneval = {"records": 3, "device": "cpu",
                 "methods": {"eagle-chain": {"tau": 1.9, "tokens_per_s": None, "acceptance_by_position": [0.5]}},
                 "lossless": {"eagle-chain": {"held": False, "turns": 2, "dtype": "fp32"}},
                 "seconds": {"load": 0.5, "warmup": 2.0, "decode": 8.0, "lossless_check": 1.0, "total": 11.5}}
    for name, r in (("long-chain5", long), ("sharegpt-heldout-chain5", chain), ("sharegpt-heldout-tree", tree),
                    ("humaneval-chain5", humaneval)):
        (run / "bench" / f"{name}.json").write_text(json.dumps(r))
    (run / "export" / "README.md").write_text("# drafter\n\nintro\n\n## SGLang\n\n`serve it "
                                              "--speculative-num-steps 5 `\n\n## vLLM\n\n`or this`\n")
    (run / "logs" / "prewarm.log").write_text("compiling\nIntel oneMKL FATAL ERROR: Cannot load "
                                              "/venv/lib/torch/lib/libtorch_cpu.so.\n\n")
    (run / "prepared" / "manifest.json").write_text(json.dumps({"config": {"regen": {"max_new_tokens": 256}}}))
    prepare = {"read": 200, "kept": 120, "heldout": 40, "tokens": 98765, "trainable_tokens": 45678, "truncated": 3,
               "skipped": {"malformed JSON": 2, "empty turn": 1}, "dropped": {"no trainable tokens": 4},
               "conversations": 60, "sent_to_regeneration": 60, "regenerated_turns": 100,
               "replies_cut_at_max_new_tokens": 64, "replies_cut_at_max_len": 2, "empty_replies": 0,
               "generated_tokens": 5000, "generation_tokens_per_s": 812.345}
    train = {"step": 3, "vocab_coverage": 0.9876,
             "train": {"acc_k": [0.5, 0.3, 0.2]},
             "eval": {"acc_k": [0.61, 0.42, 0.3], "cond_acc_k": [0.61, 0.66, 0.7], "baseline_acc_0": 0.07,
                      "tau_est": 2.345, "round_tau_by_chain": [1.61, 2.12, 2.53, 2.84, 3.05, 3.16],
                      "round_tau_first_by_chain": [1.5, 1.9, 2.2, 2.5, 2.7, 2.8]}}
    state = {"created": "2026-12-02T17:00:00Z", "stages": {
        "prepare": {"seconds": 12.4, "summary": prepare},
        "capture": {"seconds": 30.6, "summary": {"samples": 120, "bytes_per_token": 4104}},
        "train": {"seconds": 100.2, "summary": train},
        "bench": {"seconds": 60.0},
        "export": {"seconds": 1.0, "summary": {"path": str(run / "export")}}},
        "train_prewarm": {"pid": 11, "seconds": 40.0, "returncode": 0, "startup": {"first_step_s": 9.0}},
        "prewarm": {"pid": 12, "seconds": 3.1, "returncode": 2, "finished_before_bench": True, "waited_s": 0.0}}
    return state, SimpleNamespace(preset="cpu-demo", target="tiny", data="toy.jsonl")


def test_the_report_of_a_run_with_every_section_reads_exactly_as_written(tmp_path):
    """report.md and the summary, byte for byte: the verdict with its table, notes, warnings and serve commands,
    the tables, the cells of both checks, the bench stage's sums and the plot links (support/golden/report.md; {RUN} stands
    for the run directory)."""
    run = tmp_path / "run"
    state, cfg = full_run(run)
    summary = write_report(run, state, cfg)
    assert (run / "report.md").read_text() == GOLDEN.read_text().replace("{RUN}", str(run))
    assert summary == SUMMARY.replace("{RUN}", str(run))
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["acc_k.png", "acceptance.png", "loss.png",
                                                                  "scaling.png"]


def test_a_norm_before_fc_export_carries_its_engine_warning_into_the_report_and_summary(tmp_path):
    """A drafter trained with norm_before_fc, exported for real: report.md's export section and the end-of-run
    summary repeat the export README's warning (older SGLang drops the norm silently), not only the README."""
    import torch

    from support.models import make_tiny_llama
    from eyas.export.export import NORM_BEFORE_FC_NOTE, export_drafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    run = tmp_path / "run"
    state, cfg = full_run(run)
    model = make_tiny_llama(layers=6, seed=5)
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=model.config.vocab_size,
                                                aux_layer_ids=(1, 2, 3), norm_before_fc=True))
    export_drafter(d, run / "export", dtype="fp32")
    summary = write_report(run, state, cfg)
    section = (run / "report.md").read_text().split("## Export", 1)[1]
    assert f"**Warning:** {NORM_BEFORE_FC_NOTE}" in section.split("### SGLang", 1)[0]
    assert summary.splitlines()[-2] == f"  export warning: {NORM_BEFORE_FC_NOTE}"


def _verdict(report: str) -> str:
    """The verdict section of a report.md, which must come first after the header."""
    assert report.split("\n## ", 2)[1].startswith("Verdict"), "the report does not open with its verdict"
    return report.split("## Verdict", 1)[1].split("\n## ", 1)[0]


def _benches(run: Path, benches: dict) -> None:
    for d in ("bench", "export"):
        (run / d).mkdir(parents=True, exist_ok=True)
    for name, r in benches.items():
        (run / "bench" / f"{name}.json").write_text(json.dumps(r))


def test_a_run_of_both_drafter_kinds_shows_them_side_by_side_and_serves_the_faster(tmp_path):
    """An EAGLE-3 chain and a DFlash block drafter benched on the same sets: one column each, the DFlash drafter
    (faster on the held-out set) served, and the set where the chain is faster said so."""
    from test_report import _bench, _method

    run = tmp_path / "run"
    dflash = {"method": "chain", "k": 15}
    lookup = _method(1.1, 1.1, "lookup")
    _benches(run, {
        "sharegpt-heldout-chain5": _bench({"lookup": lookup, "eagle-chain": _method(2.5, 1.6, "eagle-3 chain of 5 drafts")},
                                          CHAIN5),
        "sharegpt-heldout-dflash": _bench({"lookup": lookup, "dflash": _method(3.4, 2.1, "dflash block 16 (15 drafts)")},
                                          dflash),
        "humaneval-chain5": _bench({"lookup": lookup, "eagle-chain": _method(2.8, 1.9, "eagle-3 chain of 5 drafts")},
                                   CHAIN5),
        "humaneval-dflash": _bench({"lookup": lookup, "dflash": _method(2.6, 1.7, "dflash block 16 (15 drafts)")},
                                   dflash)})
    summary = write_report(run, {"stages": {}}, SimpleNamespace(preset="gpu", target="t", data="d"))
    v = _verdict((run / "report.md").read_text())
    assert v.startswith("\n\nServe the drafter as **dflash block 16 (15 drafts)**: on held-out ShareGPT (the prompt "
                        "set with the most drafter settings measured) it decodes 2.10x as fast as plain decoding and "
                        "1.91x as fast as prompt lookup (measured tau 3.40).")
    assert ("| prompt set | prompts | dflash block 16 (15 drafts) | eagle-3 chain of 5 drafts | prompt lookup | "
            "fastest | dflash block 16 (15 drafts) against prompt lookup |") in v
    assert ("| held-out ShareGPT | 3 | **2.10x** (tau 3.40) | 1.60x (tau 2.50) | 1.10x (tau 1.10) | dflash block 16 "
            "(15 drafts) | 1.91x |") in v
    assert ("| HumanEval | 3 | 1.70x (tau 2.60) | **1.90x** (tau 2.80) | 1.10x (tau 1.10) | eagle-3 chain of 5 drafts "
            "| 1.55x |") in v
    assert "- On HumanEval eagle-3 chain of 5 drafts is faster (1.90x vs 1.70x for dflash block 16 (15 drafts))." in v
    assert "  verdict: Serve the drafter as dflash block 16 (15 drafts): on held-out ShareGPT" in summary


@pytest.mark.parametrize("lookup, plain_wins", [(1.4, False), (0.9, True)])
def test_where_a_baseline_beats_every_drafter_setting_the_verdict_serves_the_baseline(tmp_path, lookup, plain_wins):
    """Prompt lookup faster than the drafter on the main set: serve prompt lookup; every speculative method slower
    than plain decoding: serve plain decoding. Neither is dressed up as a drafter win."""
    from test_report import _bench, _method

    run = tmp_path / "run"
    drafter = 0.8 if plain_wins else 1.2
    _benches(run, {"sharegpt-heldout-chain5": _bench({"lookup": _method(1.1, lookup, "lookup"),
                                                      "eagle-chain": _method(1.9, drafter, "eagle-3 chain of 5 drafts")},
                                                     CHAIN5)})
    write_report(run, {"stages": {}}, SimpleNamespace(preset="gpu", target="t", data="d"))
    v = _verdict((run / "report.md").read_text())
    if plain_wins:
        assert v.startswith("\n\nServe **plain decoding**: on held-out ShareGPT every speculative method is slower "
                            "than plain decoding (the best drafter setting, eagle-3 chain of 5 drafts: 0.80x).")
        assert "| plain decoding |" in v and "is slower than plain decoding (0.80x)" not in v
    else:
        assert v.startswith("\n\nServe **prompt lookup**, not the drafter: on held-out ShareGPT prompt lookup is "
                            "faster (1.40x plain decoding) than the best drafter setting, eagle-3 chain of 5 drafts "
                            "(1.20x).")
        assert "| **1.40x** (tau 1.10) | prompt lookup | 0.86x |" in v
    assert "should you serve it" in v or not (run / "export" / "README.md").exists()


@pytest.mark.parametrize("cut, warned", [(19, False), (20, True)])
def test_a_fifth_of_regenerated_replies_cut_at_their_length_limit_is_a_warning(tmp_path, cut, warned):
    """The warning starts at 20% of the regenerated replies stopped by prepare.max_new_tokens, and names the share,
    the counts and the limit the prepare manifest recorded."""
    run = tmp_path / "run"
    state, cfg = full_run(run)
    state["stages"]["prepare"]["summary"].update(regenerated_turns=100, replies_cut_at_max_new_tokens=cut)
    state.pop("prewarm")
    write_report(run, state, cfg)
    v = _verdict((run / "report.md").read_text())
    line = (f"- {cut}% of the regenerated replies ({cut} of 100) stopped at the reply length limit "
            "(prepare.max_new_tokens = 256) before their end")
    assert (line in v) is warned and ("### Warnings" in v) is warned


@pytest.mark.parametrize("returncode, how", [(2, "failed (exit status 2)"), (-15, "was stopped before it finished"),
                                             (0, None)])
def test_every_failed_background_warm_up_is_a_warning_with_its_log_line(tmp_path, returncode, how):
    """A warm-up that failed or was stopped is named with the last line of its log; one that finished with its
    result is not mentioned."""
    run = tmp_path / "run"
    state, cfg = full_run(run)
    state["train_prewarm"] = {"pid": 11, "seconds": 40.0, "returncode": returncode,
                              **({"startup": {"first_step_s": 9.0}} if returncode == 0 else {})}
    state.pop("prewarm")
    (run / "logs" / "train-prewarm.log").write_text("loading\nRuntimeError: CUDA out of memory\n")
    write_report(run, state, cfg)
    v = _verdict((run / "report.md").read_text())
    line = (f"- The background warm-up of training's compile (during prepare) {how}, so training compiled its graphs "
            "itself and the run took longer; logs/train-prewarm.log ends: `RuntimeError: CUDA out of memory`.")
    if how:
        assert line in v
    else:
        assert "warm-up" not in v


def test_the_report_shows_one_predicted_tau_and_no_internal_names(tmp_path):
    """The training's other tau estimates stay out of the report; the one it shows says it is a prediction; no
    counter key, metric name or function name of the stages is printed as is."""
    run = tmp_path / "run"
    state, cfg = full_run(run)
    summary = write_report(run, state, cfg)
    report = (run / "report.md").read_text()
    ev = state["stages"]["train"]["summary"]["eval"]
    for other in ev["tau_est"], *ev["round_tau_by_chain"]:
        assert f"{other:.2f}" not in report
    # the verdict, the training section and the scaling table: each "predicted" says from what
    assert len(re.findall(r"predicted (tau )?from held-out replay", report.lower())) == report.lower().count(
        "predicted") == 3
    keys = {k for k in state["stages"]["prepare"]["summary"] if "_" in k} | {"round_counts", "tau_est", "acc_k |",
                                                                               "train/metrics", "bytes_per_token"}
    for text in report, summary:
        assert not [k for k in keys if k in text]
    # above the bench tables (whose method names are the bench JSON's): no snake_case word outside code spans, a
    # plot's file name and the recipe settings a user sets (prepare.max_new_tokens)
    words = re.sub(r"`[^`]*`|\(plots/\w+\.png\)|\bprepare\.\w+", "", report.split("## Speculative decoding")[0])
    assert not re.findall(r"\b[a-z]+_[a-z_]+\b", words)


def test_no_two_of_many_plot_lines_share_a_style():
    """The acceptance plot draws one line per bench and method (ten and more in the gpu preset): each line's
    colour, dash and marker together differ from every other's."""
    styles = [tuple(_style(i).values()) for i in range(40)]
    assert len(set(styles)) == len(styles)
