"""The online target forward of training (`target_features`): right-padded rows with their padding mask, against
the same rows with no mask (causal only: in a right-padded row no real token can see a pad, so the real tokens'
states are the same math, and SDPA may take its causal flash kernel instead of a masked one).

    PYTHONPATH=src python benchmarks/target_forward.py                 # GPU: SmolLM2-shaped, 16 rows of <= 2048
    PYTHONPATH=src python benchmarks/target_forward.py --device cpu --rows 2 --seq 128 --no-record   # smoke test

Prints ms per forward for each mode and the largest difference on real tokens; appends a dated section to
BENCHMARKS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from capture import smollm2_shaped  # noqa: E402
from eyas.target.hooks import LayerInputs, decoder_stack  # noqa: E402


def forward(target, ids, valid, masked: bool):
    base = decoder_stack(target.model)
    with LayerInputs(base.layers, target.aux_layer_ids) as cap:
        final = base(input_ids=ids, attention_mask=valid.long() if masked else None, use_cache=False).last_hidden_state
    n = len(base.layers)
    return torch.cat([final if i == n else cap.states[i] for i in target.aux_layer_ids], dim=-1)


def timed(fn, reps: int, sync) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = smollm2_shaped(args.device, dtype)
    g = torch.Generator().manual_seed(0)
    lengths = sorted(torch.randint(128, args.seq + 1, (args.rows,), generator=g).tolist(), reverse=True)
    lengths[0] = args.seq
    T = max(lengths)
    ids = torch.randint(3, 49152, (args.rows, T), generator=g)
    valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    ids, valid = ids.masked_fill(~valid, 0).to(dev), valid.to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    with torch.no_grad():
        ref = forward(target, ids, valid, True)
        fast = forward(target, ids, valid, False)
        diff = (ref - fast)[valid].abs().max().item()
        scale = ref[valid].abs().max().item()
        for name, masked in (("padding mask", True), ("causal only", False)):
            rows.append((name, timed(lambda: forward(target, ids, valid, masked), args.reps, sync)))
    tokens = sum(lengths)
    lines = ["| mode | ms / forward | real tokens / s | vs mask |", "|---|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s * 1e3:.1f} | {tokens / s:,.0f} | {rows[0][1] / s:.2f}x |")
    note = (f"{args.rows} right-padded rows, {tokens:,} real tokens (lengths 128..{args.seq}, one {T}-token row), "
            f"{str(dtype).replace('torch.', '')}, aux + final states; largest |difference| on real tokens {diff:.3g} "
            f"(largest |state| {scale:.3g}).")
    print("\n".join(lines) + "\n\n" + note)
    if not args.no_record:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or platform.machine()
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python " + " ".join(["benchmarks/target_forward.py", *sys.argv[1:]])
        with open(ROOT / "BENCHMARKS.md", "a") as f:
            f.write(f"\n## Online target forward, mask or causal only — {when}\n\nMachine: {name}, torch "
                    f"{torch.__version__}. Command: `{cmd}`\n\n" + "\n".join(lines) + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
