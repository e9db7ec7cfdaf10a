"""The training loop: `run_train(cfg, target=None) -> dict` (final metrics).

RUN/
  manifest.json          kind "train": resolved config, target fingerprint, source reference, counts, result
  vocab/                 draft_vocab.safetensors (token_ids, d2t, t2d) + summary.json (size, coverage)
  checkpoints/step-N/    model, optimizer, scheduler, data position, RNG states (atomic; see checkpoint.py)
  drafter/               config.json + model.safetensors (eyas.model.checkpoint.save_drafter)
  metrics.jsonl, tb/     train records every log_every steps, eval records at the end of each epoch

One optimizer step on a rank = grad_accum micro-batches (data.rank_batches); the loss of a micro-batch is the TTT
loss (mean over its counted positions) / grad_accum, and DDP averages over ranks, so W ranks x A micro-batches
give the same update as one process with A*W micro-batches of the same data.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eyas.errors import EyasError
from eyas.manifest import MANIFEST, atomic_write_bytes, check_same, check_target, read_manifest, write_manifest
from eyas.train import checkpoint as ckpt
from eyas.train.config import TrainConfig
from eyas.train.data import (PreparedSource, StoreSource, epoch_batches, group, group_packed, nonfinite_rows, pack,
                             rank_batches, split_indices, target_features)
from eyas.train.metrics import MetricsSink, Sums, frequency_baseline, truncate_metrics
from eyas.train.ttt import TTTConfig, TTTOutput, ttt_forward

KIND = "train"


class TTTModule(nn.Module):
    """The drafter plus its TTT loss behind one forward(), so DDP / FSDP2 hooks see every step."""

    def __init__(self, drafter: nn.Module, ttt: TTTConfig):
        super().__init__()
        self.drafter, self.ttt = drafter, ttt

    def forward(self, input_ids, loss_mask, valid, aux, final, embed_weight, lm_head_weight, segment_ids=None,
                position_ids=None):
        o = ttt_forward(self.drafter, input_ids=input_ids, loss_mask=loss_mask, valid=valid, aux=aux, final=final,
                        embed=embed_weight, lm_head_weight=lm_head_weight, cfg=self.ttt, segment_ids=segment_ids,
                        position_ids=position_ids)
        return o.loss, o.loss_k, o.count_k, o.correct_k, o.cond_count_k, o.cond_correct_k


# --------------------------------------------------------------------------------------------------- setup
def _dist_setup(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if want_cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if want_cuda:
        if not torch.cuda.is_available():
            raise EyasError(f"--device {cfg.device}: CUDA is not available on this machine")
        if world > 1:
            idx = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            idx = 0 if cfg.device == "auto" else (torch.device(cfg.device).index or 0)
        device = torch.device("cuda", idx)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _open_source(cfg: TrainConfig, target, device: torch.device):
    """(source, target, reference dict for the manifest). Refuses a store/target mismatch."""
    from eyas.target import load_target

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.online:
        from eyas.data.prepared import PreparedData

        if target is None:
            target = load_target(cfg.target, device=device, dtype=dtype)
        data = PreparedData(cfg.data, target=target)
        ref = {"data": str(Path(cfg.data).resolve()), "data_manifest": data.manifest.get("config")}
        return PreparedSource(data, max_len=cfg.max_len), target, ref
    from eyas.store.reader import Store

    store = Store(cfg.store)
    if target is None:
        spec = cfg.target or store.manifest.get("config", {}).get("target") or store.fingerprint.get("identity")
        # Offline needs only the embedding and lm_head; the target stays on the CPU.
        target = load_target(spec, device="cpu", dtype=dtype, aux_layer_ids=store.aux_layer_ids)
    warning = check_target(store.fingerprint, target.fingerprint, where=str(store.path),
                           allow_mismatch=cfg.allow_target_mismatch)
    if tuple(store.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise EyasError(f"{store.path}: store aux layers {list(store.aux_layer_ids)} != the target's "
                        f"{list(target.aux_layer_ids)}")
    if store.hidden_size != target.hidden_size:
        raise EyasError(f"{store.path}: store hidden size {store.hidden_size} != the target's {target.hidden_size}")
    ref = {"store": str(Path(cfg.store).resolve()), "store_samples": len(store), "store_dtype": store.store_dtype,
           "aux_layer_ids": list(store.aux_layer_ids), **({"target_mismatch": warning} if warning else {})}
    return StoreSource(store, max_len=cfg.max_len, feature_dtype=dtype), target, ref


def _build_vocab(cfg: TrainConfig, source, train_idx, V: int, init_vocab, run: Path):
    from eyas.model.vocab import DraftVocab, build_draft_vocab, save_draft_vocab

    counts = torch.zeros(V, dtype=torch.int64)
    for i in train_idx:
        ids, mask = source.tokens(i)
        picked = ids[mask]
        if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= V):
            raise EyasError(f"{source.where}: sample {source.ids[i]!r} has a token id outside [0, {V})")
        counts += torch.bincount(picked, minlength=V)
    if int(counts.sum()) == 0:
        raise EyasError(f"{source.where}: the training split has no trainable (loss-masked) tokens")
    if init_vocab is not None:
        d2t, t2d = init_vocab
        tok = torch.arange(d2t.numel()) + d2t
        vocab = DraftVocab(token_ids=tok, d2t=d2t, t2d=t2d, coverage=float(counts[tok].sum()) / int(counts.sum()))
    else:
        vocab = build_draft_vocab(counts, min(32000, V) if cfg.draft_vocab is None else cfg.draft_vocab)
    top_draft = int(vocab.token_ids[counts[vocab.token_ids].argmax()])
    if run is not None:
        (run / "vocab").mkdir(parents=True, exist_ok=True)
        save_draft_vocab(vocab, run / "vocab" / "draft_vocab.safetensors")
        summary = {"size": vocab.size, "vocab_size": V, "coverage": vocab.coverage, "most_common_id": top_draft,
                   "trainable_tokens": int(counts.sum()), "split": "train"}
        atomic_write_bytes(run / "vocab" / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    return vocab, top_draft


def _schedule(cfg: TrainConfig, total: int):
    warm = int(cfg.warmup_ratio * total)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        p = min(1.0, (step - warm) / max(1, total - warm))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def _full_state(module: nn.Module, optim, fsdp: bool) -> tuple[dict, dict | None]:
    """Full (unsharded, CPU) model state dict of the drafter, and the optimizer state."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(module, options=opts)
        opt = get_optimizer_state_dict(module, optim, options=opts) if optim is not None else None
    else:
        model = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        opt = optim.state_dict() if optim is not None else None
    return {k.removeprefix("drafter."): v for k, v in model.items()}, opt


def _load_full_state(module: nn.Module, optim, model_state: dict, opt_state: dict, fsdp: bool) -> None:
    model_state = {f"drafter.{k}": v for k, v in model_state.items()}
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, model_state, options=opts)
        set_optimizer_state_dict(module, optim, opt_state, options=opts)
    else:
        module.load_state_dict(model_state)
        optim.load_state_dict(opt_state)


# ---------------------------------------------------------------------------------------------------- run
def run_train(cfg: TrainConfig, target=None) -> dict:
    """Train a drafter as configured; returns the final metrics (train + last eval)."""
    from eyas.model.checkpoint import save_drafter
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter

    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    rank, world, device = _dist_setup(cfg)
    run = Path(cfg.out)
    if rank == 0:
        _check_run_dir(cfg, run)
    _barrier()
    source, target, ref = _open_source(cfg, target, device)
    train_idx, eval_idx = split_indices(source, cfg.eval_fraction)
    if not train_idx:
        raise EyasError(f"{source.where}: no training samples (empty data, all samples shorter than 3 tokens, "
                        f"or all held out by --eval-fraction {cfg.eval_fraction})")

    if cfg.draft_vocab is not None and cfg.draft_vocab > target.vocab_size:
        raise EyasError(f"--draft-vocab {cfg.draft_vocab} is larger than the target's vocabulary "
                        f"({target.vocab_size} tokens of {cfg.target or 'the store target'}); use at most {target.vocab_size}")
    init_drafter, init_vocab = None, None
    if cfg.init:
        from eyas.model.checkpoint import open_drafter  # eyas runs and published EAGLE-3 checkpoints

        # checks the drafter's recorded target (each differing field named), or warns with --allow-target-mismatch
        init_drafter, meta = open_drafter(cfg.init, target, allow_target_mismatch=cfg.allow_target_mismatch)
        init_vocab = (init_drafter.d2t.clone(), init_drafter.t2d.clone())
    vocab, top_id = _build_vocab(cfg, source, train_idx, target.vocab_size, init_vocab, run if rank == 0 else None)

    # --- the drafter, its loss module and the optimizer
    torch.manual_seed(cfg.seed)
    dcfg = DrafterConfig.from_target(target.config, draft_vocab_size=vocab.size, aux_layer_ids=target.aux_layer_ids,
                                     intermediate_size=cfg.intermediate_size)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    if init_drafter is not None:
        if init_drafter.config != dcfg:
            check_same(init_drafter.config.to_dict(), dcfg.to_dict(), what="drafter config of --init", where=cfg.init)
        drafter.load_state_dict(init_drafter.state_dict())
    elif cfg.init_from_target:
        init_head_from_target(drafter, target)
    drafter.to(device)
    if cfg.compile:
        from torch import _dynamo
        _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)  # K steps x train/eval
        drafter.midlayer.compile(dynamic=False)  # in place: the state-dict keys stay the export keys
    ttt = TTTConfig(num_steps=cfg.ttt_steps, decay=cfg.decay, chunk_size=cfg.chunk_size, attention=cfg.attention)
    # packed rows: (rows, row_len) of every micro-batch, a fixed shape
    packed = (max(1, cfg.batch_tokens // cfg.max_len), cfg.max_len) if cfg.packs(device) else None
    module = TTTModule(drafter, ttt)
    if cfg.fsdp:
        if world < 2:
            raise EyasError("--fsdp needs torchrun with at least 2 processes")
        from torch.distributed.fsdp import fully_shard
        fully_shard(module.drafter.midlayer)
        fully_shard(module)
        model = module
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda"
                                                    else None)
    else:
        model = module
    params = [p for p in module.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                              foreach=device.type == "cuda")
    embed_w = target.embed_tokens.weight.detach().to(device)
    lm_w = embed_w if target.tie_word_embeddings else target.lm_head.weight.detach().to(device)
    t2d = drafter.t2d

    # --- the plan: steps per epoch are fixed by (seed, epoch, lengths)
    def plan(epoch: int):
        mb = epoch_batches(train_idx, source.lengths, batch_tokens=cfg.batch_tokens, seed=cfg.seed, epoch=epoch,
                           packed=packed)
        return rank_batches(mb, rank=rank, world_size=world, grad_accum=cfg.grad_accum)
    if not plan(0):
        raise EyasError(f"{source.where}: {len(train_idx)} training samples make fewer micro-batches than one step "
                        f"needs ({world} rank(s) x grad_accum {cfg.grad_accum}); lower --batch-tokens")
    if cfg.steps is not None:
        total = cfg.steps
    else:
        total = sum(len(plan(e)) for e in range(cfg.epochs or 1))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _schedule(cfg, total))

    step, epoch, pos, seen = 0, 0, 0, 0
    if cfg.resume and (last := ckpt.latest_checkpoint(run)) is not None:
        state, rng = ckpt.load_checkpoint(last, rank=rank)
        check_same({**state["config"], "world_size": state["world_size"]}, {**cfg.identity(), "world_size": world},
                   what="training configuration", where=str(last))
        _load_full_state(module, optim, state["model"], state["optimizer"], cfg.fsdp)
        sched.load_state_dict(state["scheduler"])
        step, epoch, pos = state["step"], state["data"]["epoch"], state["data"]["position"]
        seen = state["data"].get("tokens_seen", 0)
        ckpt.set_rng_state(rng)
        if rank == 0:
            truncate_metrics(run / "metrics.jsonl", step)
    elif rank == 0 and (run / "metrics.jsonl").exists():
        (run / "metrics.jsonl").unlink()
    if rank == 0:
        write_manifest(run, _manifest(cfg, target, ref, dcfg, vocab, len(train_idx), len(eval_idx), world, total,
                                      status="running"))
    _barrier()

    sink = MetricsSink(run, enabled=rank == 0, total_steps=total, start_step=step, progress=cfg.progress)
    from eyas.target.device import cpu_bf16_fast
    use_bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and (device.type == "cuda" or cpu_bf16_fast()))
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 and not cfg.deterministic
           else contextlib.nullcontext())
    last_eval: dict = {}
    train_summary: dict = {}

    def save(at_step: int) -> None:
        m, o = _full_state(module, optim, cfg.fsdp)
        state = {"model": m, "optimizer": o, "scheduler": sched.state_dict(), "step": at_step,
                 "data": {"epoch": epoch, "position": pos, "tokens_seen": seen}, "config": cfg.identity(),
                 "world_size": world}
        ckpt.save_checkpoint(run, at_step, state if rank == 0 else None, rank=rank, barrier=_barrier,
                             keep=cfg.keep_checkpoints)

    def evaluate() -> dict:
        if not eval_idx:
            return {}
        model.eval()
        sums = Sums(cfg.ttt_steps, device)
        by_len = sorted(eval_idx, key=lambda i: source.lengths[i])
        batches = (group_packed(by_len, source.lengths, *packed) if packed
                   else group(by_len, source.lengths, cfg.batch_tokens))
        # FSDP2 forwards are collective: every rank runs the same number (extra ones are discarded).
        rounds = math.ceil(len(batches) / world) if cfg.fsdp else len(batches[rank::world])
        with torch.no_grad():
            for j in range(rounds):
                k = j * world + rank
                b = _features(source, batches[k % len(batches)], target, device, cfg, packed)
                with amp:  # DDP: the plain module (ranks may run different numbers of eval batches)
                    o = TTTOutput(*module(b.input_ids, b.loss_mask, b.valid, b.aux, b.final, embed_w, lm_w,
                                          b.segment_ids, b.position_ids))
                    base = frequency_baseline(b.input_ids, b.loss_mask, b.valid, b.final, lm_w, t2d, top_id)
                if k < len(batches):
                    sums.add(o, b.num_tokens, base)
        model.train()
        return sums.all_reduce().summary(token_weighted=True)

    model.train()
    steps_plan = plan(epoch)
    while step < total:
        micro = steps_plan[pos]
        sums = Sums(cfg.ttt_steps, device)
        for a, idx in enumerate(micro):
            b = _features(source, idx, target, device, cfg, packed)
            bad = nonfinite_rows(b)
            sync = a == len(micro) - 1 or not isinstance(model, nn.parallel.DistributedDataParallel)
            with (contextlib.nullcontext() if sync else model.no_sync()):
                with amp:
                    lmask = b.valid if cfg.loss_on == "all" else b.loss_mask
                    o = TTTOutput(*model(b.input_ids, lmask, b.valid, b.aux, b.final, embed_w, lm_w, b.segment_ids,
                                         b.position_ids))
                _stop_if_nonfinite(bad, o.loss, b.ids, step + 1, "features" if bad else "loss")
                (o.loss / len(micro)).backward()
            sums.add(o, b.num_tokens)
        gnorm = nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        _stop_if_nonfinite([], gnorm, [i for idx in micro for i in (source.ids[j] for j in idx)], step + 1,
                           "gradient norm")
        lr = sched.get_last_lr()[0]
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        step, pos = step + 1, pos + 1
        train_summary = sums.all_reduce().summary()
        seen += train_summary["tokens"]  # all ranks: the x axis of the scaling curve
        rate = sink.step(train_summary["tokens"], {"loss": f"{train_summary['loss']:.3f}",
                                                   "acc0": f"{train_summary['acc_k'][0]:.3f}"})
        if step % cfg.log_every == 0 or step == total:
            sink.log({"step": step, "split": "train", "epoch": epoch, "tokens_seen": seen, "lr": lr, "grad_norm": float(gnorm),
                      "tokens_per_s": rate, **train_summary})
        end_of_epoch = pos == len(steps_plan)
        if end_of_epoch or step == total or (cfg.eval_every and step % cfg.eval_every == 0):  # held-out eval
            last_eval = evaluate()
            if last_eval:
                sink.log({"step": step, "split": "eval", "epoch": epoch, "tokens_seen": seen, **last_eval})
                sink.note(f"eval @ step {step}: acc_0 {last_eval['acc_k'][0]:.3f} (frequency baseline "
                          f"{last_eval.get('baseline_acc_0', float('nan')):.3f}), tau_est {last_eval['tau_est']:.2f}")
            if end_of_epoch:
                epoch, pos = epoch + 1, 0
                steps_plan = plan(epoch)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == total:
            save(step)
    sink.close()

    # --- the final drafter
    m, _ = _full_state(module, None, cfg.fsdp)
    result = {"step": step, "train": train_summary, "eval": last_eval, "vocab_coverage": vocab.coverage}
    if rank == 0:
        final = Eagle3Drafter(dcfg)
        final.load_state_dict(m)
        save_drafter(final, run / "drafter", meta={"target": target.fingerprint})
        write_manifest(run, {**_manifest(cfg, target, ref, dcfg, vocab, len(train_idx), len(eval_idx), world, total,
                                         status="complete"), "result": result})
    _barrier()
    return result


@torch.no_grad()
def init_head_from_target(drafter, target) -> None:
    """Start the drafter's output side as the target's: final norm and the LM-head rows of the draft vocabulary.

    The drafter's last hidden state then lives in the target's output space from step 0, which is where
    it has to end up; everything else keeps its random init."""
    rows = drafter.token_ids.to(target.lm_head.weight.device)
    drafter.lm_head.weight.copy_(target.lm_head.weight[rows].float())
    drafter.norm.weight.copy_(target.final_norm.weight.float())


def _features(source, idx, target, device, cfg: TrainConfig, packed: tuple[int, int] | None):
    b = source.collate(idx).to(device)
    if cfg.online:
        b = target_features(target, b, sub_tokens=cfg.batch_tokens if packed else None)
    return pack(b, *packed) if packed else b


def _stop_if_nonfinite(bad_ids: list[str], value: torch.Tensor, ids: list[str], step: int, what: str) -> None:
    """All ranks agree whether any rank saw NaN/Inf; then every rank raises, naming the samples it holds."""
    flag = torch.tensor([1.0 if (bad_ids or not torch.isfinite(value).all()) else 0.0], device=value.device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        local = bad_ids or ([] if torch.isfinite(value).all() else ids)
        names = local
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            names = [i for g in gathered for i in g]
        raise EyasError(f"step {step}: NaN/Inf in {what}, sample(s) {', '.join(map(repr, names)) or '(another rank)'}")


def _check_run_dir(cfg: TrainConfig, run: Path) -> None:
    if run.exists() and not run.is_dir():
        raise EyasError(f"{run}: exists and is not a directory")
    if (run / MANIFEST).exists():
        old = read_manifest(run)
        if old.get("kind") != KIND:
            raise EyasError(f"{run}: holds a {old.get('kind')!r} directory, not a training run")
        if cfg.resume:
            check_same(old["config_identity"], cfg.identity(), what="training configuration", where=str(run))
        elif ckpt.list_checkpoints(run):
            raise EyasError(f"{run}: already holds a run with checkpoints; pass --resume or choose another --out")
    elif run.is_dir() and any(run.iterdir()):
        # a run killed before its first manifest leaves only the draft vocabulary (and temp files): start over
        early = all(p.name == "vocab" or (p.name.startswith(".") and ".tmp-" in p.name) for p in run.iterdir())
        if not early:
            raise EyasError(f"{run}: not empty and not an eyas training run; refusing to write into it")
        shutil.rmtree(run / "vocab", ignore_errors=True)
        for p in run.glob(".*.tmp-*"):
            p.unlink(missing_ok=True)
    run.mkdir(parents=True, exist_ok=True)


def _manifest(cfg, target, ref, dcfg, vocab, n_train, n_eval, world, total, *, status) -> dict:
    return {"kind": KIND, "status": status, "config": cfg.to_dict(), "config_identity": cfg.identity(),
            "target": target.fingerprint, "source": ref, "drafter": dcfg.to_dict(),
            "counts": {"train_samples": n_train, "eval_samples": n_eval}, "world_size": world,
            "total_steps": total, "vocab": {"size": vocab.size, "coverage": vocab.coverage},
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
