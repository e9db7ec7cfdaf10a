"""What an fp8 store costs: the same drafter trained on an fp8 store and on a bf16 store of the same data.

    python benchmarks/fp8_store.py --prepared RUN/prepared --steps 60            # CPU, a few minutes
    python benchmarks/fp8_store.py --prepared RUN/prepared --device cuda --steps 500

Captures the prepared data twice (bf16, fp8), reports bytes per token and the per-state relative error
of fp8 against bf16, trains two drafters with identical configuration and seed, and compares their
held-out acc_k. Prints a table and appends a dated section to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eyas.capture import CaptureConfig, run_capture  # noqa: E402
from eyas.store import Store  # noqa: E402
from eyas.target import load_target  # noqa: E402
from eyas.train.config import TrainConfig  # noqa: E402
from eyas.train.trainer import run_train  # noqa: E402


def relative_errors(a: Store, b: Store, n: int = 20) -> list[float]:
    """Per state (aux low, mid, high, final): ||b - a|| / ||a|| over the first n samples."""
    num, den = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for i in range(min(n, len(a))):
        x, y = a.get(i, torch.float32), b.by_id(a.ids[i], torch.float32)
        xs = torch.cat([x.aux, x.final[:, None]], 1).double()  # (T,4,h)
        ys = torch.cat([y.aux, y.final[:, None]], 1).double()
        num += (ys - xs).pow(2).sum((0, 2))
        den += xs.pow(2).sum((0, 2))
    return (num / den).sqrt().tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", required=True, help="an eyas prepare output directory")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="target weights dtype")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--dir", default="/tmp/eyas-bench-fp8")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target = load_target(args.target, device=args.device, dtype=dtype)
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    rows, stores = [], {}
    for sd in ("bf16", "fp8"):
        out = work / f"store-{sd}"
        run_capture(CaptureConfig(out=str(out), target=args.target, data=args.prepared, dtype=sd,
                                  device=args.device, progress=False), target)
        stores[sd] = Store(out, target=target)
    err = relative_errors(stores["bf16"], stores["fp8"])
    for sd, store in stores.items():
        cfg = TrainConfig(out=str(work / f"train-{sd}"), store=str(store.path), target=args.target,
                          steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, ttt_steps=args.ttt_steps,
                          draft_vocab=args.draft_vocab, device=args.device, eval_fraction=0.1, seed=0,
                          autocast="bf16", progress=False)
        r = run_train(cfg, target)
        rows.append((sd, store.info()["bytes_per_token"], r["eval"]["acc_k"], r["eval"]["cond_acc_k"],
                     r["eval"]["loss"], r["eval"]["tau_est"]))
    lines = ["| store | bytes/token | held-out acc_k | held-out cond acc_k | held-out loss | tau_est |",
             "|---|---|---|---|---|---|"]
    for sd, bpt, acc, cond, loss, tau in rows:
        lines.append(f"| {sd} | {bpt} | {' / '.join(f'{a:.3f}' for a in acc)} | "
                     f"{' / '.join(f'{a:.3f}' for a in cond)} | {loss:.3f} | {tau:.3f} |")
    table = "\n".join(lines)
    note = (f"fp8 relative error vs bf16 (aux low, mid, high, final): {', '.join(f'{e:.4f}' for e in err)}. "
            f"{len(stores['bf16'])} samples, {stores['bf16'].num_tokens:,} tokens from {args.prepared}; "
            f"{args.steps} steps of {args.batch_tokens} tokens, K={args.ttt_steps}, draft vocab {args.draft_vocab}, "
            f"lr {args.lr}, same seed; target {args.dtype} on {args.device}.")
    print(table)
    print(note)
    if not args.no_record:
        dev = (torch.cuda.get_device_name() if args.device.startswith("cuda")
               else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:])
        with open(ROOT / "BENCHMARKS.md", "a") as f:
            f.write(f"\n## fp8 vs bf16 store: drafter quality — {now}\n\nMachine: {dev}, torch {torch.__version__}. "
                    f"Command: `{cmd}`\n\n{table}\n\n{note}\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
