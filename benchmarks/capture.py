"""Capture throughput: bare forward vs captured-and-written, bf16 and fp8, next to the disk's write speed.

    python -m benchmarks.capture                       # GPU: SmolLM2, 32 batches of 32 x 1024; a CPU smoke test:
    python -m benchmarks.capture --device cpu --batches 2 --batch-size 2 --seq 256 --random-weights --no-record

Prints a table and appends a dated section to BENCHMARKS.md (benchmarks.record: --md FILE, --no-record).
Ratio = tokens/s divided by bare-forward tokens/s in the same run (goal: the disk-bound ceiling). Each store dtype
is captured twice in this run: with overlap=False (.cpu() after every forward, shards serialised and written in
the same thread) and with the overlapped pipeline (pinned staging buffers and side-stream copies, intake and writer
threads; store/writer.py), so their ratio is measured within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks import record
from eyas.capture import CaptureConfig, run_capture
from eyas.store import Store
from eyas.store import format as fmt
from eyas.target import load_target
from eyas.target.hooks import capture_states, decoder_stack


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def disk_write_speed(path: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Bytes/s to write and fsync `nbytes` into a fresh file (buffered writes, like the store)."""
    buf = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // chunk):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return nbytes // chunk * chunk / dt


def smollm2_shaped(device: str, dtype: torch.dtype):
    """A random-weight Llama with SmolLM2-135M-Instruct's configuration (throughput does not depend on weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target import target_from_model

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return target_from_model(model, name="smollm2-135m-shaped (random weights)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp/eyas-bench-capture", help="where the stores and the disk test write")
    ap.add_argument("--disk-gb", type=float, default=2.0)
    ap.add_argument("--shard-mb", type=float, default=256)
    record.add_options(ap)
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2-135M's exact architecture with random weights (same speed, no GGUF to stage)")
    args = ap.parse_args()

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    if args.random_weights:
        target = smollm2_shaped(args.device, dtype)
    else:
        target = load_target(args.target, device=args.device, dtype=dtype)
    load_s = time.perf_counter() - t0
    B, T, n = args.batch_size, args.seq, args.batches
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (n, B, T), generator=g)        # (batches, B, T)
    tokens = n * B * T
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    disk = disk_write_speed(work / "disk-test.bin", int(args.disk_gb * (1 << 30)))
    base = decoder_stack(target.model)

    def bare():
        with torch.inference_mode():
            for k in range(n):
                base(input_ids=ids[k].to(args.device), use_cache=False).last_hidden_state
        sync(args.device)

    def hooks_only(store_dtype):
        with torch.inference_mode():
            for k in range(n):
                s = capture_states(target.model, target.aux_layer_ids, ids[k].to(args.device))  # (B, T, 4, h)
                q, scale = fmt.quantize(s.reshape(B * T, 4, -1), store_dtype)
                q.cpu()
        sync(args.device)

    def hooks_pinned(store_dtype, depth=3):
        """As hooks_only, but the copies go to `depth` pinned buffers on a side stream (what the writer does)."""
        stream, bufs, done = torch.cuda.Stream(), [None] * depth, [None] * depth
        with torch.inference_mode():
            for k in range(n):
                s = capture_states(target.model, target.aux_layer_ids, ids[k].to(args.device))  # (B, T, 4, h)
                q, scale = fmt.quantize(s.reshape(B * T, 4, -1), store_dtype)
                j = k % depth
                if done[j] is not None:
                    done[j].synchronize()
                dev = [t for t in (q, scale) if t is not None]
                bufs[j] = bufs[j] or [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in dev]
                ready = torch.cuda.Event()
                ready.record()
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    for t, h in zip(dev, bufs[j]):
                        h.copy_(t, non_blocking=True)
                        t.record_stream(stream)
                    done[j] = torch.cuda.Event()
                    done[j].record(stream)
        sync(args.device)

    bare()  # warm-up (kernels, allocator)
    t = time.perf_counter()
    bare()
    bare_s = time.perf_counter() - t
    rows = [("bare forward (decoder stack, no lm_head)", tokens / bare_s, None, None)]
    samples = [(f"b{k}-{b}", ids[k, b].tolist(), [1] * T) for k in range(n) for b in range(B)]
    rate = {}
    for sd in ("bf16", "fp8"):
        hooks_only(sd)
        t = time.perf_counter()
        hooks_only(sd)
        rows.append((f"{sd}: hooks + quantise + .cpu(), no write", tokens / (time.perf_counter() - t), None, None))
        if args.device.startswith("cuda"):
            hooks_pinned(sd)
            t = time.perf_counter()
            hooks_pinned(sd)
            rows.append((f"{sd}: hooks + quantise + pinned side-stream copy, no write",
                         tokens / (time.perf_counter() - t), None, None))
        for overlap in (False, True):
            out = work / f"store-{sd}-{overlap}"
            # run_capture timed whole: sample checks, data hash, forward, and the last shard's write + fsync
            cfg = CaptureConfig(out=str(out), dtype=sd, batch_tokens=B * T, device=args.device, progress=False,
                                shard_mb=args.shard_mb, overlap=overlap)
            sync(args.device)
            t = time.perf_counter()
            run_capture(cfg, target, samples=samples)
            dt = time.perf_counter() - t
            info = Store(out).info()
            how = "overlapped" if overlap else "synchronous, overlap=False"
            rows.append((f"{sd}: captured and written, {how}", tokens / dt, info["bytes"] / dt,
                         info["bytes_per_token"]))
            rate[sd, overlap] = tokens / dt
            shutil.rmtree(out)

    head = f"| {'what':<56} | {'tokens/s':>12} | {'ratio':>6} | {'MB/s written':>12} | {'bytes/token':>11} |"
    sep = "|" + "-" * 58 + "|" + "-" * 14 + "|" + "-" * 8 + "|" + "-" * 14 + "|" + "-" * 13 + "|"
    lines = [head, sep]
    for what, tps, bps, bpt in rows:
        lines.append(f"| {what:<56} | {tps:>12,.0f} | {tps / rows[0][1]:>6.2f} | "
                     f"{'' if bps is None else f'{bps / 1e6:,.0f}':>12} | {'' if bpt is None else bpt:>11} |")
    lines.append(f"| {'disk: write + fsync ' + f'{args.disk_gb:g} GiB':<56} | {'':>12} | {'':>6} | "
                 f"{disk / 1e6:>12,.0f} | {'':>11} |")
    table = "\n".join(lines)
    h = target.hidden_size
    note = (f"{target.name}, h={h}, aux={list(target.aux_layer_ids)}, model dtype {str(dtype)[6:]}, "
            f"{n} batches of {B} x {T} random ids ({tokens:,} tokens), shards of {args.shard_mb:g} MiB, "
            f"target load {load_s:.1f} s. "
            f"Disk-bound ceiling: bf16 {disk / fmt.bytes_per_token('bf16', h):,.0f} tok/s, "
            f"fp8 {disk / fmt.bytes_per_token('fp8', h):,.0f} tok/s. "
            "Overlapped / synchronous capture: "
            + ", ".join(f"{sd} {rate[sd, True] / rate[sd, False]:.2f}x" for sd in ("bf16", "fp8")) + ".")
    print(table)
    print(note)
    record.write(args, "Capture throughput", f"{table}\n\n{note}", command=record.command_line(__spec__.name),
                 machine=record.device_name(args.device))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
