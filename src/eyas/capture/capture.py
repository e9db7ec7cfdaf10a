"""The capture stage: run the target over prepared samples and write aux + final hidden states to a store."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

import eyas.target  # load_target looked up at call time: tests patch it
from eyas.data.prepared import PreparedData  # the data stage, left of capture in the pipeline
from eyas.errors import EyasError
from eyas.store import format as fmt
from eyas.store.lock import acquire_store_lock
from eyas.store.writer import StoreWriter
from eyas.target import check_aux_layer_ids
from eyas.target.hooks import capture_states


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    out: str
    """Store directory to write (created; resumed if it holds a store of the same configuration)."""
    target: str = "smollm2-135m"
    """Target model: embedded name, HF directory, hub id or GGUF path (a loaded target passed in replaces it)."""
    data: str | None = None
    """Prepared data directory (eyas prepare output)."""
    layers: tuple[int, ...] | None = None
    """Three layer ids, counted as HF counts hidden states (low, mid, high); default: the target's (2, N//2, N-3)."""
    dtype: str = "bf16"
    """Stored dtype of the hidden states: bf16, or fp8 (e4m3 + per-token, per-state scale)."""
    batch_tokens: int = 16384
    """Token budget of one forward batch (padded batch size x longest sample)."""
    device: str = "cpu"
    """cpu or cuda (cuda:LOCAL_RANK under torchrun)."""
    overwrite: bool = False
    """Replace a store of another configuration in the output directory instead of refusing."""
    limit: int | None = None
    """Capture only the first N samples of the data."""
    shard_mb: float = 512
    """Target shard size in MiB of hidden states (a shard closes at the first batch past it)."""
    writer_threads: int = 4
    """Background threads that serialise, hash and fsync shards."""
    overlap: bool = True
    """Copy to the host and write shards in background threads while the next batch runs (False: one thread)."""
    progress: bool = True
    """Show a progress bar."""
    trust_remote_code: bool = False
    """Allow the target's own code (its tokenizer or config); a target that needs it is refused without."""

    def __post_init__(self):
        if self.dtype not in fmt.DTYPES:
            raise EyasError(f"dtype {self.dtype!r}: expected one of {sorted(fmt.DTYPES)}")
        if self.batch_tokens < 1 or self.shard_mb <= 0 or self.writer_threads < 1:
            raise EyasError("batch_tokens, shard_mb and writer_threads must be positive")
        if self.limit is not None and self.limit < 1:
            raise EyasError(f"limit {self.limit}: must be positive")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise EyasError(f"device {self.device!r}: expected cpu or cuda")


def _samples_sha256(samples: list) -> str:
    h = hashlib.sha256()
    for sid, ids, mask in samples:
        h.update(json.dumps([sid, list(ids), list(mask)]).encode())
    return h.hexdigest()


def _normalise(samples: Iterable, where: str, vocab: int) -> list[tuple[str, list[int], list[int]]]:
    """(id, input_ids, loss_mask) tuples or Sample objects -> checked tuples."""
    out, seen = [], set()
    for s in samples:
        sid, ids, mask = (s.id, s.input_ids, s.loss_mask) if hasattr(s, "input_ids") else s
        sid, ids, mask = str(sid), [int(t) for t in ids], [int(m) for m in mask]
        if sid in seen:
            raise EyasError(f"{where}: sample {sid!r} appears twice")
        if not ids or len(ids) != len(mask):
            raise EyasError(f"{where}: sample {sid!r}: {len(ids)} input ids and {len(mask)} loss-mask "
                            f"entries (expected the same non-zero number)")
        if min(ids) < 0 or max(ids) >= vocab:
            raise EyasError(f"{where}: sample {sid!r}: token id outside the target vocabulary [0, {vocab})")
        seen.add(sid)
        out.append((sid, ids, mask))
    return out


def make_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped longest first so that len(batch) * longest <= budget (a longer sample goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _load_data(cfg: CaptureConfig, target) -> tuple[list, dict]:
    if cfg.data is None:
        raise EyasError("capture: no --data given (a prepared directory)")
    data = PreparedData(cfg.data, target=target)
    sha = hashlib.sha256((Path(cfg.data) / "manifest.json").read_bytes()).hexdigest()
    return list(data), {"source": "prepared", "manifest_sha256": sha}


def run_capture(cfg: CaptureConfig, target=None, *, samples: Iterable | None = None,
                rank: int | None = None, world_size: int | None = None) -> dict:
    """Capture every sample (this rank's share) into cfg.out; returns the store manifest.

    `samples` (iterable of Sample or (id, input_ids, loss_mask)) replaces cfg.data, for tests and tools.
    Rank and world size default to the RANK / WORLD_SIZE environment of torchrun.
    """
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    # one writer per rank of a store, taken before the (slow) target load: a second capture on the same --out
    # refuses at once, naming the holder; the kernel drops the lock of a killed capture
    with acquire_store_lock(cfg.out, rank):
        return _run_capture(cfg, target, samples, rank, world_size)


def _reload_spec(spec: str) -> str:
    """A target spec that loads the same target from another working directory."""
    p = Path(spec).expanduser()
    return str(p.resolve()) if p.exists() else spec


def _run_capture(cfg: CaptureConfig, target, samples: Iterable | None, rank: int, world_size: int) -> dict:
    # config.target is what `eyas train --store S` loads when it is given no --target: the spec this capture loaded
    # (a local path made absolute: a directory's identity is only its name), or the name of a target passed in
    spec = target.name if target is not None else _reload_spec(cfg.target)
    if target is None:
        dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
        target = eyas.target.load_target(cfg.target, device=cfg.device, dtype=dtype,
                                         trust_remote_code=cfg.trust_remote_code)
    aux = check_aux_layer_ids(cfg.layers if cfg.layers is not None else target.aux_layer_ids, target.num_layers)
    if samples is None:
        raw, data_id = _load_data(cfg, target)
        where = cfg.data
    else:
        raw, where = list(samples), "samples"
        data_id = None
    all_samples = _normalise(raw, where, target.vocab_size)
    if data_id is None:
        data_id = {"source": "in-memory", "sha256": _samples_sha256(all_samples)}
    if cfg.limit is not None:
        all_samples = all_samples[: cfg.limit]

    header = {"config": {**asdict(cfg), "target": spec, "layers": list(aux), "world_size": world_size},
              "target": target.fingerprint, "layers": {"aux": list(aux)}, "dtype": cfg.dtype,
              "hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "data": data_id}
    kw = dict(header=header, rank=rank, world_size=world_size, overwrite=cfg.overwrite,
              shard_bytes=int(cfg.shard_mb * (1 << 20)), threads=cfg.writer_threads,
              overlap=cfg.overlap)
    if rank == 0:
        writer = StoreWriter(cfg.out, **kw)
        _barrier()
    else:
        _barrier()
        writer = StoreWriter(cfg.out, **kw)

    mine = [s for k, s in enumerate(all_samples) if k % world_size == rank and s[0] not in writer.committed_ids]
    try:
        _capture_loop(target, aux, mine, writer, cfg)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    _barrier()
    return writer.finalize({s[0] for s in all_samples})


def _capture_loop(target, aux, samples: list, writer: StoreWriter, cfg: CaptureConfig) -> None:
    model, device = target.model, target.device
    batches = make_batches([len(s[1]) for s in samples], cfg.batch_tokens)
    total = sum(len(s[1]) for s in samples)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"capture r{writer.rank}",
               disable=not cfg.progress, smoothing=0.1)
    t0, done = time.perf_counter(), 0
    bpt = fmt.bytes_per_token(cfg.dtype, target.hidden_size)
    try:
        for batch in batches:
            group = [samples[i] for i in batch]
            lengths = [len(s[1]) for s in group]
            B, T = len(group), max(lengths)
            ids = torch.zeros(B, T, dtype=torch.long)
            mask = torch.zeros(B, T, dtype=torch.bool)
            for b, (_, tok, _) in enumerate(group):
                ids[b, : len(tok)] = torch.tensor(tok)
                mask[b, : len(tok)] = True
            padded = min(lengths) < T
            # no attention mask: rows are right-padded, so causal attention alone keeps every real token from the
            # padding after it (the same states, bit for bit), and SDPA runs its causal kernel, which skips the
            # upper triangle, instead of reading a dense (B, T, T) mask over all of it
            states = capture_states(model, aux, ids.to(device), None)                           # (B, T, 4, h)
            flat = states.reshape(B * T, *states.shape[2:])                                      # (B*T, 4, h)
            if padded:  # gather real tokens with host-computed indices: no device->host sync here
                keep = mask.flatten().nonzero().squeeze(1).to(flat.device, non_blocking=True)
                flat = flat.index_select(0, keep)                                                # (N, 4, h)
            q, scale = fmt.quantize(flat, cfg.dtype)
            writer.add([s[0] for s in group], lengths, ids[mask].to(torch.int32),
                       torch.tensor([m for s in group for m in s[2]], dtype=torch.uint8), q, scale)
            done += sum(lengths)
            bar.update(sum(lengths))
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{done * bpt / dt / 1e6:.1f} MB/s")
    finally:  # an error's line starts on a line of its own
        bar.close()
