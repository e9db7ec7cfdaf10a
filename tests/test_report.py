"""RUN/report.md and the end-of-run summary: every section, read from a run directory that has them all."""

import json
from pathlib import Path
from types import SimpleNamespace

from eyas.report import write_report

GOLDEN = Path(__file__).with_name("report_golden.md")
SUMMARY = "\n".join([
    "", "=" * 72, "eyas run (cpu-demo) finished: {RUN}",
    "  data: 120 conversations, 45678 trainable tokens, store 4104 B/token",
    "  held-out acc_k: 0.61 / 0.42 / 0.30 (frequency baseline 0.07)",
    "  long: tau 2.41 (prompt lookup 1.31, no drafter 1.00), speedup 1.52x on cpu, lossless yes (fp32 rerun of 4 "
    "turns), bf16 agreement 3/4 turns; 2 prompts of 2100-5000 tokens (1 conversation tau 2.20, 1 document tau 2.62)",
    "  short: tau 1.90 (prompt lookup 0.00, no drafter 1.00), speedup -x on cpu, lossless NO (fp32, 2 turns)",
    "  export: {RUN}/export  (serve commands in {RUN}/report.md)",
    "=" * 72])


def full_run(run: Path) -> tuple[dict, SimpleNamespace]:
    """A run directory whose stages wrote every part the report reads; -> (run state, run config)."""
    (run / "train").mkdir(parents=True)
    (run / "bench").mkdir()
    (run / "export").mkdir()
    rows = [{"split": "train", "step": s, "loss": 3.0 - s / 10, "acc_k": [0.1 * s, 0.05 * s, 0.02 * s]}
            for s in (1, 2, 3)]
    rows += [{"split": "eval", "step": s, "loss": 2.9 - s / 10, "acc_k": [0.2 * s, 0.1 * s, 0.05 * s],
              "tokens_seen": 1000 * s, "tau_est": 1.0 + s / 3} for s in (1, 3)]
    (run / "train" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn line\n")
    eagle = {"tau": 2.41, "tau_ci95": [2.1, 2.7], "tokens_per_s": 55.25, "speedup": 1.52,
             "acceptance_by_position": [0.8, 0.6, 0.4], "tau_by_kind": {"conversation": 2.2, "document": 2.62}}
    long = {"records": 2, "device": "cpu",
            "methods": {"plain": {"tau": 1.0, "tokens_per_s": 36.3, "speedup": 1.0},
                        "lookup": {"tau": 1.31, "tokens_per_s": 40.0, "speedup": 1.1, "acceptance_by_position": []},
                        "eagle-chain5": eagle},
            "lossless": {"lookup": {"held": True, "turns": 4, "dtype": "fp32"},
                         "eagle-chain5": {"held": True, "turns": 4, "rerun": True}},
            "agreement": {"eagle-chain5": {"dtype": "bf16", "identical_turns": 3, "turns": 4,
                                           "mean_prefix_tokens": 41.25, "mean_prefix_share": 0.83}},
            "seconds": {"load": 1.25, "warmup": 10.5, "decode": 30.0, "lossless_check": 4.0, "total": 46.0},
            "prompts": {"tokens": {"min": 2100, "median": 3000, "max": 5000},
                        "kinds": {"conversation": 1, "document": 1}}}
    short = {"records": 3, "device": "cpu",
             "methods": {"eagle-tree": {"tau": 1.9, "tokens_per_s": None, "acceptance_by_position": [0.5]}},
             "lossless": {"eagle-tree": {"held": False, "turns": 2, "dtype": "fp32"}},
             "seconds": {"load": 0.5, "warmup": 2.0, "decode": 8.0, "lossless_check": 1.0, "total": 11.5}}
    (run / "bench" / "long.json").write_text(json.dumps(long))
    (run / "bench" / "short.json").write_text(json.dumps(short))
    (run / "export" / "README.md").write_text("# drafter\n\nintro\n\n## SGLang\n\n`serve it`\n\n## vLLM\n\n`or this`\n")
    prepare = {"read": 200, "kept": 120, "heldout": 40, "tokens": 98765, "trainable_tokens": 45678, "truncated": 3,
               "skipped": {"malformed JSON": 2, "empty turn": 1}, "dropped": {"no trainable tokens": 4},
               "conversations": 60, "generated_tokens": 5000, "generation_tokens_per_s": 812.345}
    train = {"step": 3, "vocab_coverage": 0.9876,
             "train": {"acc_k": [0.5, 0.3, 0.2]},
             "eval": {"acc_k": [0.61, 0.42, 0.3], "cond_acc_k": [0.61, 0.66, 0.7], "baseline_acc_0": 0.07,
                      "tau_est": 2.345, "round_tau_by_chain": [1.6, 2.1], "round_tau_first_by_chain": [1.5, 1.9]}}
    state = {"created": "2026-12-02T17:00:00Z", "stages": {
        "prepare": {"seconds": 12.4, "summary": prepare},
        "capture": {"seconds": 30.6, "summary": {"samples": 120, "bytes_per_token": 4104}},
        "train": {"seconds": 100.2, "summary": train},
        "bench": {"seconds": 60.0},
        "export": {"seconds": 1.0, "summary": {"path": str(run / "export")}}}}
    return state, SimpleNamespace(preset="cpu-demo", target="tiny", data="toy.jsonl")


def test_the_report_of_a_run_with_every_section_reads_exactly_as_written(tmp_path):
    """report.md and the summary, byte for byte: tables, the cells of both checks, the bench stage's sums, the plot
    links and the export's serve commands (report_golden.md; {RUN} stands for the run directory)."""
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

    from conftest import make_tiny_llama
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
