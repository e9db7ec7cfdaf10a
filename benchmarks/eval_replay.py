"""The training eval's replayed chain tau over all replies and over first replies only (issue 12: the gap).

    PYTHONPATH=src python benchmarks/eval_replay.py --prepared RUN/prepared --drafter RUN/train/drafter \
        [--eval-fraction 0.01] [--ttt-steps 6]

Runs `Trainer.evaluate()` (the held-out TTT pass that `eyas train` logs) with the drafter loaded through --init
and no training step, on the eval split of the prepared data (a smaller --eval-fraction is a subset of the
run's split: the split is a threshold on a hash of the id). It reports metrics.round_counts' replayed decoding tau
for chains of 1..K drafts twice: over every assistant reply (what the run's eval line and report.md show) and
over each sample's first reply (what `eyas bench` decodes). Appends the table, with date, machine and command,
to BENCHMARKS.md (or --md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepared", required=True, help="an eyas prepare output directory")
    ap.add_argument("--drafter", required=True, help="the drafter to evaluate (a run's train/drafter or export)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--eval-fraction", type=float, default=0.01)
    ap.add_argument("--ttt-steps", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--md", default="BENCHMARKS.md")
    args = ap.parse_args()
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import Trainer

    vocab = json.loads((Path(args.drafter) / "config.json").read_text()).get("draft_vocab_size")
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(out=out, data=args.prepared, target=args.target, init=args.drafter, steps=1, draft_vocab=vocab,
                          ttt_steps=args.ttt_steps, max_len=args.max_len, batch_tokens=args.batch_tokens,
                          eval_fraction=args.eval_fraction, device=args.device, progress=False)
        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        ev = trainer.evaluate()
        secs = time.perf_counter() - t0
    n = len(trainer.eval_idx)
    allr, first = ev["round_tau_by_chain"], ev["round_tau_first_by_chain"]
    K = len(allr)
    rows = ["| replies | " + " | ".join(f"chain-{j}" for j in range(1, K + 1)) + " |", "|---|" + "---|" * K,
            "| all (the eval's number) | " + " | ".join(f"{t:.2f}" for t in allr) + " |",
            "| first of each sample (the bench's) | " + " | ".join(f"{t:.2f}" for t in first) + " |",
            "| all / first | " + " | ".join(f"{a / f:.3f}" for a, f in zip(allr, first)) + " |"]
    dev = trainer.device
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})"
    section = [f"## Replayed chain tau, all replies vs first replies — "
               f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
               f"- machine: {machine}; torch {torch.__version__}; autocast as `eyas train` picks it",
               f"- command: `python benchmarks/eval_replay.py {' '.join(sys.argv[1:])}`",
               f"- {n} samples of the eval split (eval_fraction {args.eval_fraction}), {ev['tokens']:,} tokens; "
               f"held-out acc_0 {ev['acc_k'][0]:.3f}; evaluate() took {secs:.0f} s", "", *rows, ""]
    text = "\n".join(section)
    print(text)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
