"""Drafter training throughput: tokens/s, MFU against the card's measured bf16 matmul rate, peak memory.

    python -m benchmarks.train --batch-tokens 32768 --online     # GPU: SmolLM2 + 8B shapes
    python -m benchmarks.train --shapes smollm2 --seqs 2048 --batch-tokens 32768 --attention flex \
        --compile 1 --online --feature-cache off,device,host,split --trainer 10  # the target's share; cached epochs
    python -m benchmarks.train --device cpu --shapes tiny --seqs 128 --steps 2   # smoke test
    python -m benchmarks.train --shapes kimi --seqs 2048,8192 --attention flex --compile 1
    torchrun --nproc_per_node 2 -m benchmarks.train --shapes llama8b --seqs 2048 # DDP scaling (NCCL)
    torchrun --nproc_per_node 2 -m benchmarks.train --shapes kimi --seqs 2048,8192 --fsdp --json r.json  # FSDP2
    torchrun --nproc_per_node 2 -m benchmarks.train --device cpu --shapes tiny --seqs 128 --steps 1 --fsdp  # gloo
    python -m benchmarks.train --method dflash --block 8,16 --shapes kimi --seqs 4096 --attention flex \
        --compile 1                                                     # the Kimi-shaped DFlash drafter (5 layers)

Each row times full optimizer steps of the trainer's own pieces (TTTModule = drafter + TTT loss, bf16 autocast,
AdamW, grad clip): per rank and step, batch_tokens // seq packed rows of `seq` tokens holding random samples of
128..seq tokens, all trainable; random features, or (--online) a target's forward on the samples (SmolLM2-shaped,
or for the tiny shape a 4-layer tiny Llama), or (--feature-cache device|host|split) the states of that forward
gathered from eyas.train.feature_cache as training's epochs after the first do (held on the device, in pinned host
memory, or the first half of the samples on the device and the rest pinned). An online row also times the feature
step alone (`feat ms`: the target's forward, or the gather), so its share of the step is measured, not estimated;
the cached rows' rate is the steady rate of epochs 2 and later.
MFU counts useful FLOPs only: 3x the forward matmuls of the trained parts (fc once per token; per TTT step the
q/k/v/o, MLP and lm_head matmuls plus causal attention over t/2 + k keys) and 1x the frozen target logits
(full vocab once per token for the argmax, draft vocab once per step for the soft targets).
--method dflash times the DFlash drafter (DFlashModule = drafter + block loss; --dflash-layers deep, --block tokens a
block, --anchors blocks per row) on the same rows; its useful FLOPs: 3x fc and every layer's context k/v (T tokens)
and block q/k/v/o + MLP + attention over the anchor's prefix and its block (anchors x block queries), 2x the head's
product on the B-1 drafted slots (its weight is the target's, frozen: no weight gradient), 1x the target's logits
on those slots (the soft labels).
Under torchrun every rank trains its own copy of the rows (DDP, or FSDP2 with --fsdp, wrapped by eyas.train.dist
as `eyas train` wraps it); tokens/s counts all ranks, and peak memory and the parameter bytes a rank holds (FSDP2:
its shards) are the largest over the ranks.
Prints a table and appends a dated section to BENCHMARKS.md (benchmarks.record: --md FILE, --no-record); --json
writes the rows too.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks import record
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.train.dflash import BlockLossConfig, DFlashModule
from eyas.train.trainer import TTTModule
from eyas.train.ttt import TTTConfig

# name -> (h, heads, kv heads, head_dim, intermediate, target vocab, draft vocab)
SHAPES = {
    "tiny": (64, 4, 2, 16, 128, 512, 256),
    "smollm2": (576, 9, 3, 64, 1536, 49152, 32000),
    "llama8b": (4096, 32, 8, 128, 14336, 128256, 32000),
    # Kimi-K2 / K2.5 (and DeepSeek-V3 bar its 129,280 vocabulary): DrafterConfig.from_target's head for them, as the
    # published Kimi EAGLE-3 heads; 1.19B parameters, about 19 GB with fp32 AdamW state: GPU only
    "kimi": (7168, 64, 64, 128, 18432, 163840, 32000),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, n: int, reps: int) -> float:
    """Measured dense matmul FLOP/s (bf16 on GPU, fp32 on CPU)."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def useful_flops(c: DrafterConfig, T: int, K: int) -> float:
    h, ht, nh, nkv, hd = c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    per_step = 2 * (2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * c.intermediate_size + h * c.draft_vocab_size)
    trained = 2 * 3 * ht * h * T + sum(per_step * T + 2 * 2 * nh * hd * (T * (T + 1) / 2 + k * T) for k in range(K))
    frozen = 2 * ht * c.vocab_size * T + K * 2 * ht * c.draft_vocab_size * T
    return 3 * trained + frozen


def dflash_flops(c: DFlashConfig, T: int, anchors: int) -> float:
    """Useful FLOPs of one DFlash step over a sample of T tokens with `anchors` blocks (the module docstring)."""
    h, nh, nkv, hd, B = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.block_size
    Q, L = anchors * B, c.num_hidden_layers
    ctx = 2 * len(c.aux_layer_ids) * c.target_hidden_size * h * T + L * 2 * h * 2 * nkv * hd * T
    block = L * (2 * (h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * c.intermediate_size) * Q
                 + 2 * 2 * nh * hd * Q * (T / 2 + B))
    head = 2 * h * c.vocab_size * anchors * (B - 1)
    return 3 * (ctx + block) + 2 * head + head


# shape -> the online target's (layers, intermediate): a Llama of the drafter's width and vocabulary
TARGETS = {"smollm2": (30, 1536), "tiny": (4, 128)}


def smollm2_target(device: torch.device, shape: str = "smollm2"):
    """A Llama with random weights (bf16 on CUDA, else fp32) wrapped as an eyas target, for --online rows: SmolLM2-
    135M's shape, or a 4-layer one of the tiny shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target import target_from_model

    h, nh, nkv, hd, _, V, _ = SHAPES[shape]
    layers, inter = TARGETS[shape]
    cfg = LlamaConfig(vocab_size=V, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    return target_from_model(model)


def max_over_ranks(x: float) -> float:
    """The largest `x` over the ranks (x itself in one process)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return x
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def local_param_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds: FSDP2's DTensor shards count their local part only."""
    total = 0
    for p in module.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def bench(shape: str, T: int, K: int, steps: int, chunk: int | None, device: torch.device, ddp: bool, *,
          rows: int = 1, attention: str = "auto", compile_layer: bool = False, online: bool = False,
          profile: bool = False, fsdp: bool = False, feature_cache: str = "off", method: str = "eagle3",
          block: int = 16, layers: int = 5, anchors: int = 512) -> dict:
    from eyas.train.data import Batch, pack
    from eyas.train.feature_cache import FeatureCache, Tiers, online_features

    h, nh, nkv, hd, inter, V, Vd = SHAPES[shape]
    cfg = DrafterConfig(hidden_size=h, target_hidden_size=h, intermediate_size=inter, num_attention_heads=nh,
                        num_key_value_heads=nkv, head_dim=hd, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=max(T, 8192), vocab_size=V, draft_vocab_size=Vd,
                        aux_layer_ids=(2, 16, 29))
    if method == "dflash":
        cfg = DFlashConfig(hidden_size=h, target_hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, rms_norm_eps=1e-5,
                           rope_theta=500000.0, max_position_embeddings=max(T, 8192), vocab_size=V,
                           aux_layer_ids=(2, 16, 29), num_target_layers=61, block_size=block, mask_token_id=V - 1)
    torch.manual_seed(0)
    drafter = (DFlashDrafter if method == "dflash" else Eagle3Drafter)(cfg).to(device)
    layer_list = tuple(drafter.layers) if method == "dflash" else (drafter.midlayer,)
    if compile_layer:
        from torch import _dynamo
        _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)
        for layer in layer_list:
            layer.compile(dynamic=False)
    module = (DFlashModule(drafter, BlockLossConfig(anchors=anchors, chunk_size=chunk,
                                                    attention="dense" if attention == "dense" else "flex"))
              if method == "dflash" else TTTModule(drafter, TTTConfig(num_steps=K, chunk_size=chunk,
                                                                       attention=attention)))
    model = module
    if ddp:
        import torch.distributed as tdist

        from eyas.train.dist import Dist, parallelize
        model = parallelize(module, Dist(rank=tdist.get_rank(), world=tdist.get_world_size(), device=device),
                            fsdp=fsdp, shard_first=layer_list)
    fdt = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = smollm2_target(device, shape) if online else None
    embed = (torch.randn(V, h, device=device) * 0.02).to(fdt)
    lm = (torch.randn(V, h, device=device) * 0.02).to(fdt)
    # rows packed rows of T tokens, each holding samples of 128..T tokens (a realistic mix), all trainable
    g = torch.Generator().manual_seed(1)
    lengths = []
    while True:
        n = int(torch.randint(128, T + 1, (1,), generator=g))
        if pack_rows_fit(lengths + [n], rows, T):
            lengths.append(n)
        else:
            break
    B, L = len(lengths), max(lengths)
    valid = (torch.arange(L)[None] < torch.tensor(lengths)[:, None]).to(device)              # (B, L)
    padded = Batch([str(i) for i in range(B)], torch.randint(0, V, (B, L), device=device) * valid, valid, valid)
    if not online:
        padded.aux = torch.randn(B, L, 3 * h, device=device).to(fdt)
        padded.final = torch.randn(B, L, h, device=device).to(fdt)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), foreach=device.type == "cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    cache, idx = None, list(range(B))
    if online and feature_cache != "off":   # filled by one forward, as the first epoch fills it
        need = sum(lengths) * 4 * h * torch.empty((), dtype=target.dtype).element_size()
        pinned = FeatureCache(need, torch.device("cpu"), pinned=device.type == "cuda")   # allocated at its first put
        if feature_cache == "device":
            cache = FeatureCache(need, device)
        elif feature_cache == "host":
            cache = pinned
        else:  # split: the first half of the samples on the device, the rest pinned (the two-part plan)
            cache = Tiers([FeatureCache(need // 2, device), pinned])
        online_features(cache, target, Batch(padded.ids, padded.input_ids, padded.loss_mask, padded.valid), idx,
                        lengths, sub_tokens=rows * T)
        assert all(i in cache for i in idx)

    def features():
        b = padded
        return online_features(cache, target, Batch(b.ids, b.input_ids, b.loss_mask, b.valid), idx, lengths,
                               sub_tokens=rows * T)

    def step():
        b = features() if online else padded
        b = pack(b, rows, T) if rows > 1 or attention != "dense" else b
        with amp:
            loss = model(b.input_ids, b.loss_mask, b.valid, b.aux, b.final, embed, lm, b.segment_ids,
                         b.position_ids)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tokens = sum(lengths)
    try:
        for _ in range(3):
            step()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        dt = (time.perf_counter() - t0) / steps
        feat = float("nan")
        if online:  # the feature step alone: the target's forward, or the cache's gather
            t0 = time.perf_counter()
            for _ in range(steps):
                features()
            sync(device)
            feat = (time.perf_counter() - t0) / steps
        if profile and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile as prof
            with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                step()
                sync(device)
            print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
    except torch.OutOfMemoryError:
        return {"shape": shape, "seq": T, "rows": rows, "error": "out of memory"}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    peak = float("nan") if device.type != "cuda" else max_over_ranks(peak)
    param_mib = max_over_ranks(local_param_bytes(module) / 2**20)
    target_params = sum(p.numel() for p in target.model.parameters()) if online and cache is None else 0
    if method == "dflash":  # anchors are spread over a row's samples in proportion to their length
        flops = sum(dflash_flops(cfg, n, min(anchors, T) * n / (rows * T)) for n in lengths)
    else:
        flops = sum(useful_flops(cfg, n, K) for n in lengths) + 2 * target_params * tokens
    return {"shape": shape, "seq": T, "method": method if method == "eagle3" else f"dflash-{layers}L-b{block}", "rows": rows, "tokens": tokens, "attention": attention, "compile": compile_layer,
            "online": online, "feature_cache": feature_cache if online else "off", "chunk": chunk,
            "ms_step": dt * 1e3, "tok_s": tokens / dt, "feat_ms": feat * 1e3, "flops_step": flops,
            "peak_gib": peak, "param_mib_rank": param_mib, "wrap": ("fsdp2" if fsdp else "ddp") if ddp else "none",
            # samples held per part of the cache (device first), so a row says where its states were gathered from
            "cache_samples": [len(p.at) for p in getattr(cache, "parts", [cache])] if cache is not None else []}


def trainer_bench(T: int, K: int, steps: int, device: torch.device, *, rows: int, log_every: int,
                  attention: str, compile_layer: bool, feature_cache: str = "off", shape: str = "smollm2") -> dict:
    """The real loop: eyas.train.trainer.Trainer on prepared data (random token samples of 128..T, all
    trainable) with the online target of `shape` (SmolLM2's by default), as `eyas train --online` runs it (collate,
    host-to-device copies, target forward, packing, NaN checks, metrics). Steps whose metrics are not read back
    (log_every) do not wait for the device. Rate = counted tokens / wall time of `steps` steps after warm-up.
    feature_cache: the TrainConfig field; when it is not 'off', a first epoch (untimed) fills the cache and the
    timed steps are the second epoch's."""
    import tempfile

    from eyas.data.prepared import PreparedWriter, Sample
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import Trainer

    target = smollm2_target(device, shape)
    V, Vd = SHAPES[shape][5], SHAPES[shape][6]
    g = torch.Generator().manual_seed(2)
    tmp = Path(tempfile.mkdtemp(prefix="eyas-train-bench-"))
    w = PreparedWriter(tmp / "prep", identity={"bench": 1})
    n_samples = 0
    while n_samples < (steps + 8) * rows * T // ((128 + T) // 2) * 2:
        n = int(torch.randint(128, T + 1, (1,), generator=g))
        w.add(Sample(f"s{n_samples}", torch.randint(0, V, (n,), generator=g).tolist(), [1] * n))
        n_samples += 1
    w.commit(n_samples, {})
    w.finish({"target": target.fingerprint, "counts": {"kept": n_samples}})
    cfg = TrainConfig(out=str(tmp / "run"), data=str(tmp / "prep"), target=f"random {shape}-shaped", device=str(device),
                      max_len=T, batch_tokens=rows * T, ttt_steps=K, draft_vocab=Vd, pack="on", attention=attention,
                      compile=compile_layer, eval_fraction=0.0, checkpoint_every=0, eval_every=0,
                      log_every=log_every, progress=False, steps=steps + 4, feature_cache=feature_cache)
    tr = Trainer(cfg, target)
    warm = 3 if feature_cache == "off" else len(tr.plan(0))   # compile and warm up (and fill the cache)
    for _ in range(warm):
        tr.train_step(tr.next_batch())
        if tr.loader.end_of_epoch:
            tr.loader.next_epoch()
    t0, tok0, lengths = time.perf_counter(), tr.loader.seen, []
    for i in range(steps):
        batch = tr.next_batch()
        lengths += [tr.source.lengths[j] for idx in batch for j in idx]
        tr.train_step(batch, sync=(i + 1) % log_every == 0 or i == steps - 1)
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    tokens = (tr.loader.seen - tok0) / steps
    target_params = sum(p.numel() for p in target.model.parameters()) if feature_cache == "off" else 0
    flops = (sum(useful_flops(tr.dcfg, n, K) for n in lengths) + 2 * target_params * sum(lengths)) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"shape": f"{shape} (Trainer)", "seq": T, "rows": rows, "tokens": int(tokens), "attention": attention,
            "compile": compile_layer, "online": True, "feature_cache": feature_cache, "chunk": None,
            "ms_step": dt * 1e3, "tok_s": tokens / dt, "feat_ms": float("nan"), "flops_step": flops,
            "peak_gib": peak}


def features_of(r: dict) -> str:
    """The table's word for where a row's features came from."""
    if not r.get("online"):
        return "random"
    fc = r.get("feature_cache", "off")
    return ("target" if fc == "off" else f"cache ({fc})" if fc in ("device", "host", "split")
            else f"target, cache {fc} (epoch 2)")


def shares(rows: list[dict], world: int) -> list[str]:
    """Lines under the table: per online row, the target forward's share of its step, and each cached row's rate
    against it (same shape, length, attention and compile)."""
    out = []
    key = lambda r: (r["shape"], r["seq"], r["rows"], r["attention"], r["compile"])   # noqa: E731
    base = {key(r): r for r in rows if r.get("online") and r.get("feature_cache") == "off" and "error" not in r}
    for r in rows:
        b = base.get(key(r))
        if b is None or "error" in r or not r.get("online"):
            continue
        what = f"{r['shape']} {r['seq']} x {r['rows']} {r['attention']}{' compiled' if r['compile'] else ''}"
        if r is b and b["feat_ms"] == b["feat_ms"]:
            out.append(f"- {what}: the target's forward takes {b['feat_ms']:.1f} of {b['ms_step']:.1f} ms per step "
                       f"({b['feat_ms'] / b['ms_step']:.0%}).")
        elif r is not b:
            out.append(f"- {what}, {features_of(r)}: {r['ms_step']:.1f} ms per step, {r['tok_s'] * world:,.0f} "
                       f"tokens/s, {b['ms_step'] / r['ms_step']:.2f}x the online step.")
    return out


def pack_rows_fit(lengths, rows, T) -> bool:
    from eyas.train.data import pack_rows
    return pack_rows(lengths, rows, T) is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="smollm2,llama8b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "dflash"])
    ap.add_argument("--block", default="16", help="DFlash: comma list of block sizes")
    ap.add_argument("--dflash-layers", type=int, default=5, help="DFlash: decoder layers")
    ap.add_argument("--anchors", type=int, default=512, help="DFlash: blocks per packed row")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (after 2 warm-up steps)")
    ap.add_argument("--chunk-size", type=int, default=0, help="rows per fused LM-head/loss chunk (0: default)")
    ap.add_argument("--batch-tokens", type=int, default=0, help="tokens per step: batch_tokens // seq packed rows "
                                                                  "(0: one row)")
    ap.add_argument("--attention", default="dense,flex", help="comma list of TTT attention paths to time")
    ap.add_argument("--compile", default="0", help="comma list of 0/1: torch.compile the decoder layer")
    ap.add_argument("--online", action="store_true", help="include a target forward (random weights; the smollm2 "
                                                               "and tiny shapes)")
    ap.add_argument("--feature-cache", default="off",
                    help="comma list of off/device/host/split: online rows take the states from the target's "
                         "forward (off) or from the feature cache on the device, in pinned host memory, or half in "
                         "each (split: the two-part cache of a run whose states overflow the card); the Trainer rows "
                         "run with the cache off and, for the others, 'auto' (a first epoch fills it, the second is "
                         "timed)")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one more step per row")
    ap.add_argument("--trainer", type=int, default=0, metavar="LOG_EVERY",
                    help="also time the real Trainer loop (online target of --shapes' smollm2/tiny, else smollm2; "
                         "prepared random samples), reading "
                         "metrics back every LOG_EVERY steps (0: skip; 1: every step, as before issue 12's change)")
    record.add_options(ap)
    ap.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--json", default="", help="also write the rows, ranks and matmul rate to this JSON file")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    device = torch.device(args.device)
    if world > 1:
        import torch.distributed as dist

        from eyas.train.dist import destroy_process_group, init_process_group
        init_process_group("nccl" if device.type == "cuda" else "gloo")   # not dist's: see there
        rank = dist.get_rank()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_rate(device, 8192 if device.type == "cuda" else 1024, 20 if device.type == "cuda" else 3)
    caches = args.feature_cache.split(",")
    if not set(caches) <= {"off", "device", "host", "split"}:
        ap.error(f"--feature-cache: a comma list of off, device, host, split; got {args.feature_cache!r}")
    rows = []
    for shape in args.shapes.split(","):
        for T in (int(s) for s in args.seqs.split(",")):
            for attention in args.attention.split(","):
                for comp in (c == "1" for c in args.compile.split(",")):
                    online = args.online and shape in TARGETS
                    for fcache, block in ((c, int(b)) for c in (caches if online else ["off"])
                                          for b in (args.block.split(",") if args.method == "dflash" else ["0"])):
                        r = bench(shape, T, args.ttt_steps, args.steps, args.chunk_size or None, device, world > 1,
                                  rows=max(1, args.batch_tokens // T), attention=attention, compile_layer=comp,
                                  online=online, profile=args.profile, fsdp=args.fsdp, feature_cache=fcache,
                                  method=args.method, block=block, layers=args.dflash_layers, anchors=args.anchors)
                        rows.append(r)
                        if rank == 0:
                            print(r, flush=True)
    if args.trainer and world == 1:
        for shape, T in ((s, int(t)) for s in [x for x in args.shapes.split(",") if x in TARGETS] or ["smollm2"]
                         for t in args.seqs.split(",")):
            for attention in args.attention.split(","):
                for comp in (c == "1" for c in args.compile.split(",")):
                    for fcache in dict.fromkeys("off" if c == "off" else "auto" for c in caches):
                        r = trainer_bench(T, args.ttt_steps, args.steps, device, rows=max(1, args.batch_tokens // T),
                                          log_every=args.trainer, attention=attention, compile_layer=comp,
                                          feature_cache=fcache, shape=shape)
                        rows.append(r)
                        print(r, flush=True)
    if world > 1:      # every rank leaves the group before exit (a live gloo group at exit can abort the process)
        dist.barrier()
        destroy_process_group()
    if rank != 0:
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps({"world": world, "wrap": ("fsdp2" if args.fsdp else "ddp") if world > 1
                                               else "none", "matmul_flops": peak, "rows": rows}, indent=1) + "\n")
    what = "bf16" if device.type == "cuda" else "fp32"
    lines = ["| drafter | row len x rows | tokens | ranks | attention | compiled | features | ms/step | feat ms "
             "| tokens/s (all ranks) | TFLOP/step | MFU | peak GiB | param MiB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ranks = f"{world} ({'FSDP2' if args.fsdp else 'DDP'})" if world > 1 else "1"
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['seq']} x {r['rows']} | | {ranks} | | | | {r['error']} | | | | | | |")
            continue
        mfu = r["flops_step"] / (r["ms_step"] / 1e3) / peak
        name = r["shape"] if r.get("method", "eagle3") == "eagle3" else f"{r['shape']} {r['method']}"
        lines.append(f"| {name} | {r['seq']} x {r['rows']} | {r['tokens']} | {ranks} | {r['attention']} | "
                     f"{'yes' if r['compile'] else 'no'} | {features_of(r)} | {r['ms_step']:.1f} | "
                     f"{r.get('feat_ms', float('nan')):.1f} | {r['tok_s'] * world:,.0f} | {r['flops_step'] / 1e12:.2f} "
                     f"| {mfu:.1%} | {r['peak_gib']:.1f} | {r.get('param_mib_rank', float('nan')):,.1f} |")
    table = "\n".join(lines) + "".join(f"\n{x}" if i else f"\n\n{x}" for i, x in enumerate(shares(rows, world)))
    note = (f"Measured {what} matmul rate: {peak / 1e12:.1f} TFLOP/s per device; MFU = useful "
            f"FLOPs / time / that rate. "
            + (f"DFlash: {args.dflash_layers} layers, {args.anchors} blocks per row (dflashN L-bB: N layers, block B); "
               if args.method == "dflash" else f"K = {args.ttt_steps} TTT steps; ")
            + f"per rank and step, packed rows of random "
            f"samples of 128..row-len tokens, all trainable; features: random, the target's forward on the samples, "
            f"or its states gathered from the feature cache (device / pinned host / split: half in each); feat ms: "
            f"that feature step alone. '(Trainer)' rows time the real training loop (eyas.train.trainer.Trainer) on "
            f"such samples"
            + (f", reading metrics back every {args.trainer} steps." if args.trainer else "."))
    print(table)
    print(note)
    record.write(args, "Drafter training throughput", f"{table}\n\n{note}", command=record.command_line(__spec__.name),
                 machine=f"{record.device_name(device)} x{world}")
    return 0


if __name__ == "__main__":
    from eyas.cli import leave

    leave(main())  # under torchrun without interpreter teardown (eyas.cli.leave says why); every file is closed
