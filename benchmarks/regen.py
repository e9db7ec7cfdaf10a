"""Regeneration throughput: `Runner.generate` as prepare's regeneration runs it, old way vs new way, one process.

    PYTHONPATH=src python benchmarks/regen.py                   # GPU: SmolLM2-shaped, 1024 prompts, batch 512
    PYTHONPATH=src python benchmarks/regen.py --device cpu --dtype fp32 --prompts 12 --batch 6 --max-new 24 \
        --max-seq 160 --no-record                                # smoke test

A random-weight SmolLM2-shaped target (speed does not depend on the weights) samples at temperature 1 over
a near-flat distribution; `--eos` random token ids act as end-of-turn, so reply lengths are geometric
(mean about vocab / eos tokens, capped at --max-new) like real replies of mixed length. Prompt lengths are
drawn log-uniformly from --prompt-len. Each mode decodes the same prompts; the table gives generated
tokens/s and the ratio to the first mode ("full": every step attends all max_seq slots and the whole batch
runs until its last row ends; "window+compact": the default). Appends a dated section to BENCHMARKS.md
(or to --md).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from capture import smollm2_shaped  # noqa: E402
from eyas.target.runner import Layer, Runner  # noqa: E402

MODES = {"full": dict(window=0, compact=False), "window": dict(window=256, compact=False),
         "window+compact": dict(window=256, compact=True), "matmul": dict(window=256, compact=True),
         "compiled": dict(window=256, compact=True), "compiled+regions": dict(window=256, compact=True)}
"""matmul: window+compact with the decode attention forced onto the matmul path (the default takes fused SDPA at
batch x kv heads >= Layer.sdpa_rows on CUDA). compiled: window+compact on a runner whose decode step is
torch.compile'd with dynamic shapes (prepare --regen-compile); its compile time is in the warm-up column.
compiled+regions: the same with the decoder layer compiled once for all layers (Runner.from_hf regions=True)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512, help="rows per generation forward (prepare's gen_batch)")
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--max-seq", type=int, default=2432, help="cache slots per row (prepare: max_len + max_new)")
    ap.add_argument("--prompt-len", default="30,1800", help="LO,HI: log-uniform prompt lengths")
    ap.add_argument("--eos", type=int, default=160, help="random token ids that end a reply")
    ap.add_argument("--modes", default="full,matmul,window+compact", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--md", help="write the section to this file instead of appending to BENCHMARKS.md")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    target = smollm2_shaped(a.device, dtype)
    lo, hi = map(int, a.prompt_len.split(","))
    hi = min(hi, a.max_seq - a.max_new)
    g = torch.Generator().manual_seed(0)
    V = target.model.config.vocab_size
    lens = [int(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * float(u))) for u in torch.rand(a.prompts, generator=g)]
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in lens]
    eos = torch.randint(3, V, (a.eos,), generator=g).tolist()
    runner = Runner.from_hf(target.model, max_batch=a.batch, max_seq=a.max_seq, dtype=dtype)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    rows, warm = [], {}
    for name in a.modes.split(","):
        kw = MODES[name]
        Layer.sdpa_rows = 512 if name in ("window+compact", "compiled", "compiled+regions") else 1 << 30
        r = runner if not name.startswith("compiled") else Runner.from_hf(
            target.model, max_batch=a.batch, max_seq=a.max_seq, dtype=dtype, compile=True, dynamic=True,
            regions=name == "compiled+regions")
        t0 = time.perf_counter()
        r.generate(prompts[:a.batch], 20, temperature=1.0, eos_ids=eos, seed=1, **kw)  # graphs, warm-up
        sync()
        warm[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = r.generate(prompts, a.max_new, temperature=1.0, eos_ids=eos, seed=0, **kw)
        sync()
        dt = time.perf_counter() - t0
        new = sum(map(len, out))
        rows.append((name, new, dt, new / dt))
        print(f"{name}: {new} tokens in {dt:.1f} s = {new / dt:,.0f} tok/s", flush=True)
    base = rows[0][3]
    table = ("| mode | warm-up s | generated tokens | seconds | tok/s | vs " + rows[0][0] + " |\n|---|---|---|---|---|---|\n"
             + "\n".join(f"| {n} | {warm[n]:.1f} | {t:,} | {s:.1f} | {r:,.0f} | {r / base:.2f}x |" for n, t, s, r in rows))
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor() or "cpu"
    cmd = "python benchmarks/regen.py " + " ".join(sys.argv[1:])
    mean_prompt = sum(lens) / len(lens)
    note = (f"{a.prompts} prompts (mean {mean_prompt:.0f} tokens, log-uniform {lo}-{hi}), batch {a.batch}, "
            f"max_new {a.max_new}, cache {a.max_seq} slots, {a.dtype}, temperature 1 with {a.eos} eos ids "
            f"(mean reply {sum(r[1] for r in rows) / len(rows) / a.prompts:.0f} tokens).")
    print(table)
    print(note)
    if not a.no_record:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = (f"\n## Regeneration throughput — {now}\n\nMachine: {dev}, torch {torch.__version__}. "
                   f"Command: `{cmd}`\n\n{table}\n\n{note}\n")
        with open(a.md or ROOT / "BENCHMARKS.md", "a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
