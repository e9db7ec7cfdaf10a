"""Offline training input at the seed target's scale: can the store feed the step?

    python -m benchmarks.store_read --no-record                   # Kimi-shaped (h 7168), 1 reader
    python -m benchmarks.store_read --procs 8 --no-record         # 8 readers at once, one host
    python -m benchmarks.store_read --hidden 576 --tokens 200000  # SmolLM2-shaped

Writes (or reuses: keyed by hidden size, tokens, dtype and seed, under --dir) a store per dtype (bf16, fp8) with
the real StoreWriter: samples of 256..2048 tokens, 40% of them at 2048 (long conversations cut at --max-len; mean
about 1,500 tokens), random states, shards of the capture's default 512 MiB. Then times StoreSource.collate, the
trainer's host-side read (the stored samples, the copies into padded tensors: a bf16 store converted to the feature
dtype here, an fp8 store kept fp8 with its scales and dequantized on the device by Batch.to, not timed here),
on the batches the trainer plans on CUDA (epoch_batches packed into batch_tokens // max_len rows, the rank's share
by rank_batches), in five passes per store:
  sync  fresh  a new reader, page cache dropped: as a fresh run starts, each shard's first read checks its sha256
               (reads the whole shard) before the sample is read;
  sync  cold   page cache dropped (posix_fadvise DONTNEED on every shard, after the reader opened it) first;
  sync  warm   the same batches again, from the page cache;
  pre   cold / warm   the same through eyas.train.prefetch.Prefetcher, as `eyas train` runs it, against a simulated
               step of `tokens / --step-rate` seconds (time.sleep: the GPU's step, the host idle), reporting the
               seconds the loop waited for its input.
The requirement is the step's consumption: --step-rate tokens/s per rank (default 7,728: one H200 training the
Kimi-shaped drafter at 2048-token rows, BENCHMARKS.md) times 4h bytes of features per token. With --procs N,
N processes read at once (rank r of N: its own batches, one torch thread each as under torchrun) and the rates
are summed over them. Prints a table and appends a dated section to BENCHMARKS.md (benchmarks.record: --md FILE,
--no-record).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import record
from eyas.store import format as fmt
from eyas.store.reader import Store
from eyas.store.writer import StoreWriter
from eyas.train.data import StoreSource, epoch_batches, rank_batches, split_indices
from eyas.train.prefetch import Prefetcher

AUX = [2, 30, 58]          # Kimi-K2.5 / DeepSeek-V3 (61 layers)
VOCAB = 163840
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def lengths_like_conversations(tokens: int, max_len: int, seed: int) -> list[int]:
    """Sample lengths summing to about `tokens`: 40% at max_len (cut), the rest uniform in 256..max_len-1."""
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < tokens:
        n = max_len if float(torch.rand(1, generator=g)) < 0.4 else int(torch.randint(256, max_len, (1,), generator=g))
        out.append(n)
        total += n
    return out


def write_store(path: Path, dtype: str, hidden: int, tokens: int, max_len: int, seed: int) -> Path:
    """The store under path (reused when a complete one is there)."""
    if (path / "manifest.json").exists() and json.loads((path / "manifest.json").read_text()).get("complete"):
        return path
    header = {"target": {"identity": f"store-read-bench-h{hidden}", "config_sha256": "0", "tokenizer_sha256": None},
              "layers": {"aux": AUX}, "dtype": dtype, "hidden_size": hidden, "vocab_size": VOCAB,
              "data": {"source": "benchmarks.store_read", "seed": seed}, "config": {}}
    lengths = lengths_like_conversations(tokens, max_len, seed)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(max_len, fmt.NUM_STATES, hidden, generator=g)            # (L, 4, h): sliced per sample
    q, scale = fmt.quantize(pool, dtype)
    w = StoreWriter(path, header=header, overwrite=True)
    t0 = time.perf_counter()
    for k, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32)
        w.add([f"c{k:06d}"], [n], ids, torch.ones(n, dtype=torch.uint8), q[:n], None if scale is None else scale[:n])
    w.close()
    w.finalize({f"c{k:06d}" for k in range(len(lengths))})
    print(f"wrote {path} ({sum(lengths):,} tokens, {len(lengths)} samples) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    return path


def open_source(path: Path, feature_dtype: torch.dtype, max_len: int, open_shards: bool = True) -> StoreSource:
    """A fresh reader; open_shards: with every shard opened (its sha256 checked, which reads it) before any read."""
    src = StoreSource(Store(path), max_len=max_len, feature_dtype=feature_dtype)
    for k in range(len(src.store.records) if open_shards else 0):
        src.store._shard(k)
    return src


def drop_cache(path: Path) -> None:
    for p in sorted(path.glob("shard-*.safetensors")):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def host_batch(src: StoreSource, idx: list[int]) -> tuple[int, int]:
    """What the trainer's _host_batch does (features pinned when CUDA is there); (valid tokens, padded slots)."""
    b = src.collate(idx, pin=True) if torch.cuda.is_available() else src.collate(idx)
    b.valid.sum(-1).tolist()
    return int(b.valid.sum()), b.valid.numel()


def one_pass(src: StoreSource, batches: list[list[int]], prefetch: bool, step_rate: float) -> dict:
    """Read every batch (one per step), synchronously or prefetched against a sleeping step."""
    t0, tokens, slots = time.perf_counter(), 0, 0
    if not prefetch:
        for idx in batches:
            n, m = host_batch(src, idx)
            tokens, slots = tokens + n, slots + m
        read_s = time.perf_counter() - t0
        return {"tokens": tokens, "slots": slots, "wall_s": read_s, "wait_s": read_s, "steps": len(batches)}
    with Prefetcher(enumerate(batches), lambda idx: host_batch(src, idx)) as pre:
        for j in range(len(batches)):
            n, m = pre.get(j)
            tokens, slots = tokens + n, slots + m
            time.sleep(n / step_rate)                       # the step
        wait = pre.wait_s
    return {"tokens": tokens, "slots": slots, "wall_s": time.perf_counter() - t0, "wait_s": wait,
            "steps": len(batches)}


def reader(rank: int, world: int, args, path: Path, feature_dtype: torch.dtype, barrier, out) -> None:
    torch.set_num_threads(args.threads or (1 if world > 1 else torch.get_num_threads()))
    res = {}
    for mode in ("sync", "pre"):
        src = open_source(path, feature_dtype, args.max_len, open_shards=mode == "pre")
        train_idx, _ = split_indices(src, 0.05)
        mb = epoch_batches(train_idx, src.lengths, batch_tokens=args.batch_tokens, seed=0, epoch=0,
                           packed=(max(1, args.batch_tokens // args.max_len), args.max_len))
        mine = [b[0] for b in rank_batches(mb, rank=rank, world_size=world, grad_accum=1)][: args.steps or None]
        for cache in ("fresh", "cold", "warm") if mode == "sync" else ("cold", "warm"):
            barrier.wait()
            if cache != "warm" and rank == 0:
                drop_cache(path)
            barrier.wait()
            res[f"{mode} {cache}"] = one_pass(src, mine, mode == "pre", args.step_rate)
            if cache == "fresh":     # the next passes: a reader with every shard already open
                del src
                src = open_source(path, feature_dtype, args.max_len)
        del src
    out.put((rank, res))


def run(args, dtype: str, feature: str, path: Path) -> list[dict]:
    ctx = mp.get_context("spawn")   # not fork: torch's thread pools do not survive it
    barrier, out = ctx.Barrier(args.procs), ctx.Queue()
    procs = [ctx.Process(target=reader, args=(r, args.procs, args, path, DTYPES[feature], barrier, out))
             for r in range(args.procs)]
    for p in procs:
        p.start()
    got = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    need_tok = args.step_rate * args.procs
    rows = []
    for case in got[0]:
        per = [got[r][case] for r in range(args.procs)]
        tokens, steps = sum(x["tokens"] for x in per), sum(x["steps"] for x in per)
        wall = max(x["wall_s"] for x in per)
        rows.append({"store": dtype, "features": feature, "case": case, "procs": args.procs, "tokens": tokens,
                     "padded": sum(x["slots"] for x in per) / tokens,
                     "steps": steps, "tok_s": tokens / wall if case.startswith("sync") else None,
                     "gb_s": tokens / wall * 4 * args.hidden * torch.finfo(DTYPES[feature]).bits / 8 / 1e9
                     if case.startswith("sync") else None,
                     "ms_step": 1e3 * sum(x["wait_s"] for x in per) / steps,
                     "wait_share": (sum(x["wait_s"] for x in per) / sum(x["wall_s"] for x in per)),
                     "vs_need": (tokens / wall) / need_tok if case.startswith("sync") else None})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/eyas-store-read", help="where the stores are written (reused)")
    ap.add_argument("--hidden", type=int, default=7168, help="the target's hidden size (Kimi-K2.5: 7168)")
    ap.add_argument("--tokens", type=int, default=96_000, help="tokens per store (bf16: 57,349 B/token -> 5.5 GB "
                                                               "at the default; fp8 about half)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="store dtypes")
    ap.add_argument("--features", default="bf16", help="feature dtypes to read into (the trainer: bf16 on CUDA, "
                                                       "fp32 on the CPU)")
    ap.add_argument("--max-len", type=int, default=2048, help="row length (the trainer's --max-len)")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="the trainer's --batch-tokens (its default)")
    ap.add_argument("--step-rate", type=float, default=7728.0,
                    help="tokens/s one rank's step consumes (H200, Kimi-shaped drafter, 2048-token rows)")
    ap.add_argument("--procs", type=int, default=1, help="reader processes at once (ranks on one host)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per reader (0: 1 with --procs > 1, "
                                                            "as torchrun sets, else torch's default)")
    ap.add_argument("--steps", type=int, default=0, help="batches per reader and pass (0: all of the rank's)")
    ap.add_argument("--seed", type=int, default=0)
    record.add_options(ap)
    args = ap.parse_args()

    rows = []
    for dtype in args.dtypes.split(","):
        path = write_store(Path(args.dir) / f"h{args.hidden}-t{args.tokens}-{dtype}-s{args.seed}", dtype,
                           args.hidden, args.tokens, args.max_len, args.seed)
        for feature in args.features.split(","):
            rows += run(args, dtype, feature, path)

    need = args.step_rate * 4 * args.hidden * 2 / 1e9
    lines = ["| store | features | pass | readers | steps | tokens | padded / valid | tokens/s (all) | "
             "feature GB/s (all) | x the need | input ms/step (waited) | share of the loop waiting |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt_ = (lambda v, f: "" if v is None else format(v, f))  # noqa: E731
    for r in rows:
        lines.append(f"| {r['store']} | {r['features']} | {r['case']} | {r['procs']} | {r['steps']} | "
                     f"{r['tokens']:,} | {r['padded']:.2f} | {fmt_(r['tok_s'], ',.0f')} | {fmt_(r['gb_s'], '.2f')} | "
                     f"{fmt_(r['vs_need'], '.2f')} | {r['ms_step']:.1f} | {r['wait_share']:.1%} |")
    table = "\n".join(lines)
    note = (f"Need per rank: {args.step_rate:,.0f} tokens/s = {need:.2f} GB/s of bf16 features (h {args.hidden}, "
            f"4 states); x the need = tokens/s / ({args.procs} x {args.step_rate:,.0f}). sync: the trainer's "
            f"synchronous read (prefetch off), every read is waited for; pre: prefetched against a simulated step "
            f"of tokens / {args.step_rate:,.0f} s. Rows of {args.max_len} tokens, batch_tokens {args.batch_tokens}; "
            f"padded / valid: the host batch's (B, T) slots per valid token (collate pads to the longest sample; "
            f"the rows are packed on the device). Features "
            f"{'pinned' if torch.cuda.is_available() else 'pageable (no CUDA)'}.")
    print(table)
    print(note)
    record.write(args, f"Offline training input at h {args.hidden}", f"{table}\n\n{note}",
                 command=record.command_line(__spec__.name), machine=record.device_name("cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
