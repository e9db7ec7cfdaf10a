"""The training loop: `Trainer(cfg, target)` and the thin `run_train(cfg, target=None) -> dict` (final metrics).

RUN/
  manifest.json          kind "train": resolved config, target fingerprint, source reference, counts, result
  vocab/                 draft_vocab.safetensors (token_ids, d2t, t2d) + summary.json (size, coverage)
  checkpoints/step-N/    Trainer.state_dict() (model, optimizer, scheduler, data position) + RNG states (checkpoint.py)
  drafter/               config.json + model.safetensors (eyas.model.checkpoint.save_drafter)
  metrics.jsonl, tb/     train records every log_every steps; eval records every eval_every steps (0: at the end of
                         each epoch) and after the last step

One optimizer step on a rank = grad_accum micro-batches (data.rank_batches); the loss of a micro-batch is the TTT
loss (mean over its counted positions) / grad_accum, and DDP averages over ranks, so W ranks x A micro-batches
give the same update as one process with A*W micro-batches of the same data. Ranks, the DDP / FSDP2 wrap and
full state dicts live in train/dist.py; the set-up steps (run directory, data source, draft vocabulary, head
init, lr schedule) in train/setup.py; the steps of each epoch and the data position (a checkpoint's "data") in
train/loader.py.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

import eyas.target.device  # its functions looked up at call time: tests patch them
from eyas.errors import EyasError
from eyas.manifest import check_same, write_manifest
from eyas.model.checkpoint import save_drafter
from eyas.model.checkpoint import open_drafter  # eyas runs and published EAGLE-3 checkpoints
from eyas.model.dflash import DFlashDrafter
from eyas.model.drafter import Eagle3Drafter
from eyas.target.compile import compile_cache, raise_recompile_limit
from eyas.train import checkpoint as ckpt, dist
from eyas.train.config import TrainConfig
from eyas.train.data import group, group_packed, nonfinite_flags, pack, split_indices
from eyas.train.dflash import BlockLossConfig, DFlashModule
from eyas.train.feature_cache import online_features, plan as plan_feature_cache
from eyas.train.loader import TrainLoader
from eyas.train.metrics import FiniteWatch, MetricsSink, Sums, frequency_baseline, round_counts, truncate_metrics
from eyas.train.prefetch import Prefetcher
from eyas.train.setup import (KIND, build_vocab, check_init_config, check_init_kind, check_run_dir,
                              init_head_from_target, refuse_run_dir, run_drafter_config, schedule, write_vocab)
from eyas.train.setup import open_source as _open_source  # a module global: tests hand it a target object
from eyas.train.ttt import TTTConfig, TTTOutput, ttt_forward


class TTTModule(nn.Module):
    """The drafter plus its TTT loss behind one forward(), so DDP / FSDP2 hooks see every step."""

    def __init__(self, drafter: nn.Module, ttt: TTTConfig):
        super().__init__()
        self.drafter, self.ttt = drafter, ttt

    def forward(self, input_ids, loss_mask, valid, aux, final, embed_weight, lm_head_weight, segment_ids=None,
                position_ids=None, max_counted=None, target_ids=None, alpha=False):
        o = ttt_forward(self.drafter, input_ids=input_ids, loss_mask=loss_mask, valid=valid, aux=aux, final=final,
                        embed=embed_weight, lm_head_weight=lm_head_weight, cfg=self.ttt, segment_ids=segment_ids,
                        position_ids=position_ids, max_counted=max_counted, target_ids=target_ids, alpha=alpha)
        out = (o.loss, o.loss_k, o.count_k, o.correct_k, o.cond_count_k, o.cond_correct_k, o.accept_len, o.target_ids)
        return out if o.alpha_k is None else out + (o.alpha_k,)   # TTTOutput's fields in order, alpha_k if measured


def run_train(cfg: TrainConfig, target=None) -> dict:
    """Train a drafter as configured; returns the final metrics (train + last eval). A compiled run keeps inductor's
    caches under $EYAS_CACHE/inductor (eyas.target.compile.compile_cache), where a later run, or `eyas run`'s
    warm-up during prepare (train/prewarm.py), finds them."""
    before = dist.switches()
    try:
        with compile_cache(cfg.compile):
            trainer = Trainer(cfg, target)
            result = trainer.train()
    except BaseException:
        dist.set_switches(before)  # a refused or failed run leaves the process's switches as it found them
        raise
    dist.teardown(trainer.dist)
    return result


class Trainer:
    """One training run. Construction is the set-up: ranks, run directory, data, draft vocabulary, drafter, optimizer,
    schedule, and (with cfg.resume) the latest checkpoint. Then `train_step(batch)` is one optimizer step,
    `evaluate()` the held-out pass, `state_dict()` / `load_state_dict()` what a checkpoint holds, and `train()` the
    loop: steps, metrics, evals and checkpoints until the last step, then the final drafter."""

    def __init__(self, cfg: TrainConfig, target=None):
        t0 = time.perf_counter()
        self.dist = dist.setup(cfg.device, deterministic=cfg.deterministic)
        self.rank, self.world, self.device = self.dist.rank, self.dist.world, self.dist.device
        explicit_vocab = cfg.draft_vocab
        self.cfg = cfg = self._resolve_config(cfg)
        self.run = Path(cfg.out)
        if self.rank == 0:  # read only: the run directory is made once the target and data have been checked
            refuse_run_dir(cfg, self.run)
        dist.barrier()
        self.source, self.target, self.ref = _open_source(cfg, target, self.device)
        self._split_data(explicit_vocab)
        init_drafter, init_vocab = self._open_init()
        # DFlash drafts from the target's whole vocabulary: its "draft vocabulary" is the identity
        self.vocab, self.top_id, vocab_summary = build_vocab(cfg, self.source, self.train_idx, self.target.vocab_size,
                                                             init_vocab, announce=self.rank == 0)
        self._build_model(init_drafter)
        # packed rows: (rows, row_len) of every micro-batch, a fixed shape
        self.packed = (max(1, cfg.batch_tokens // cfg.max_len), cfg.max_len) if cfg.packs(self.device) else None
        self.loader = TrainLoader(self.train_idx, self.source.lengths, batch_tokens=cfg.batch_tokens, seed=cfg.seed,
                                  grad_accum=cfg.grad_accum, rank=self.rank, world=self.world, packed=self.packed)
        if not self.loader.plan(0):
            raise EyasError(f"{self.source.where}: {len(self.train_idx)} training samples make fewer micro-batches "
                            f"than one step needs ({self.world} rank(s) x grad_accum {cfg.grad_accum}); lower "
                            f"--batch-tokens")
        self.total = (cfg.steps if cfg.steps is not None
                      else sum(len(self.loader.plan(e)) for e in range(cfg.epochs or 1)))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, schedule(cfg, self.total))
        self.amp = self._autocast()
        self.step = 0
        self.data_wait_s = 0.0   # seconds the loop waited for its training input (metrics.jsonl's data_wait_s)
        self.finite = FiniteWatch()
        # Offline, unpacked: each training sample's full-vocab target argmax, kept from its first pass, so later
        # epochs multiply only the draft vocabulary's rows of the target's head (the store's states never change).
        # Not with an LK loss: its alpha needs the target's full-vocab normaliser, so every pass multiplies it all.
        keeps = not (cfg.online or self.packed or cfg.method == "dflash") and cfg.loss == "ce"
        self.target_ids: dict[int, torch.Tensor] | None = {} if keeps else None
        self.fcache = self._feature_cache()
        if self.rank == 0:  # everything above is checked: only now the run directory and its vocabulary
            check_run_dir(cfg, self.run)
            write_vocab(self.run, self.vocab, vocab_summary)
        dist.barrier()
        self._restore()
        self.setup_s = time.perf_counter() - t0  # the train summary's start-up, with the first step's seconds

    # ------------------------------------------------------------------------------------------ set-up
    def _resolve_config(self, cfg: TrainConfig) -> TrainConfig:
        """The config with its device defaults filled in (before the run-dir check: a resume compares resolved
        values); refuses what this device cannot train."""
        cfg, chosen = cfg.for_device(self.device)
        if cfg.attention == "flex" and self.device.type != "cuda":
            raise EyasError(f"train: --attention flex trains on CUDA only (torch's flex_attention has no backward on "
                            f"the {self.device.type}); use auto, dense or blocks there")
        if chosen and self.rank == 0:
            print(chosen, file=sys.stderr)
        return cfg

    def _split_data(self, explicit_vocab: int | None) -> None:
        """The train and eval samples of the source (train_idx, eval_idx), refusing data that trains nothing and a
        --draft-vocab larger than the target's vocabulary."""
        cfg, target = self.cfg, self.target
        if hasattr(self.source, "store"):  # offline: the ranks hash the store's shards between them, once
            self.source.store.check_shards(self.rank, self.world)
            dist.long_barrier()
        self.train_idx, self.eval_idx = split_indices(self.source, cfg.eval_fraction)
        if not self.train_idx:
            raise EyasError(f"{self.source.where}: no training samples (empty data, all samples shorter than 3 "
                            f"tokens, or all held out by --eval-fraction {cfg.eval_fraction})")
        if explicit_vocab is not None and explicit_vocab > target.vocab_size:
            raise EyasError(f"--draft-vocab {explicit_vocab} is larger than the target's vocabulary "
                            f"({target.vocab_size} tokens of {cfg.target or 'the store target'}); use at most "
                            f"{target.vocab_size}")

    def _open_init(self) -> tuple[nn.Module | None, tuple | None]:
        """--init's drafter and, for EAGLE-3, its vocabulary (d2t, t2d); (None, None) without --init."""
        cfg = self.cfg
        if not cfg.init:
            return None, None
        # checks the drafter's recorded target (each differing field named), or warns with --allow-target-mismatch
        init_drafter, _ = open_drafter(cfg.init, self.target, allow_target_mismatch=cfg.allow_target_mismatch)
        check_init_kind(init_drafter, cfg)
        vocab = (init_drafter.d2t.clone(), init_drafter.t2d.clone()) if cfg.method == "eagle3" else None
        return init_drafter, vocab

    def _build_model(self, init_drafter) -> None:
        """The drafter (from --init's weights, else fresh, its head from the target's with init_from_target) and
        its loss module, wrapped for the ranks (model), and the optimizer over its trainable parameters."""
        cfg, target = self.cfg, self.target
        torch.manual_seed(cfg.seed)
        self.dcfg = run_drafter_config(cfg, target, init_drafter.config if init_drafter is not None else None)
        dflash = cfg.method == "dflash"
        self.K = self.dcfg.block_size - 1 if dflash else cfg.ttt_steps  # steps of the metrics: TTT steps or slots
        assert dflash or self.dcfg.draft_vocab_size == self.vocab.size, (self.dcfg.draft_vocab_size, self.vocab.size)
        note = check_init_config(init_drafter.config, self.dcfg, cfg.init) if init_drafter is not None else None
        drafter = (DFlashDrafter if dflash else Eagle3Drafter)(self.dcfg)
        if self.rank == 0:  # the derived shape (docs/training.md, "The drafter's shape")
            print(f"eyas train: drafter: {self.dcfg.summary()}", file=sys.stderr)
            if note:
                print(note, file=sys.stderr)
        if not dflash:
            drafter.set_vocab(self.vocab.d2t, self.vocab.t2d)
        if init_drafter is not None:
            drafter.load_state_dict(init_drafter.state_dict())
        elif cfg.init_from_target:
            init_head_from_target(drafter, target)
        drafter.to(self.device)
        if cfg.compile:
            raise_recompile_limit()  # K steps x train/eval
            for layer in drafter.layers if dflash else (drafter.midlayer,):
                layer.compile(dynamic=False)  # in place: the state-dict keys stay the export keys
        if dflash:
            attention = "dense" if cfg.attention == "blocks" else cfg.attention
            self.module = DFlashModule(drafter, BlockLossConfig(anchors=cfg.anchors, gamma=cfg.block_gamma,
                                                                labels=cfg.labels, chunk_size=cfg.chunk_size,
                                                                attention=attention))
        else:
            self.module = TTTModule(drafter, TTTConfig(num_steps=cfg.ttt_steps, decay=cfg.decay,
                                                       chunk_size=cfg.chunk_size, attention=cfg.attention,
                                                       loss=cfg.loss, lk_eta=cfg.lk_eta))
        self.model = dist.parallelize(self.module, self.dist, fsdp=cfg.fsdp,
                                      shard_first=tuple(drafter.layers) if dflash else (drafter.midlayer,))
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                       foreach=self.device.type == "cuda")
        self.embed_w = target.embed_tokens.weight.detach().to(self.device)
        self.lm_w = self.embed_w if target.tie_word_embeddings else target.lm_head.weight.detach().to(self.device)

    def _autocast(self):
        """The forward's autocast context: bf16 on CUDA and on CPUs with native bf16 unless the config says."""
        cfg = self.cfg
        use_bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and (self.device.type == "cuda"
                                                                           or eyas.target.device.cpu_bf16_fast()))
        if cfg.autocast == "auto" and self.rank == 0:  # the device picked it: say which
            why = ("CUDA" if self.device.type == "cuda" else
                   "this CPU has native bf16" if use_bf16 else "this CPU has no native bf16 (AVX512-BF16/AMX)")
            print(f"eyas train: autocast {'bf16' if use_bf16 else 'off (fp32)'} on {self.device.type}: {why} "
                  f"(--autocast bf16|off to choose)", file=sys.stderr)
        return (torch.autocast(self.device.type, dtype=torch.bfloat16) if use_bf16 and not cfg.deterministic
                else contextlib.nullcontext())

    def _feature_cache(self):
        """Online: the target's states of each sample from its first pass, for the later ones
        (train/feature_cache.py); None offline."""
        if not self.cfg.online:
            return None
        target = self.target
        h, item = target.hidden_size, torch.empty((), dtype=target.dtype).element_size()
        needed = sum(self.source.lengths[i] for i in self.train_idx + self.eval_idx) * 4 * h * item
        fcache, where = plan_feature_cache(self.cfg.feature_cache, needed, self.device)
        if self.rank == 0:
            print(f"eyas train: feature cache: {where} (--feature-cache auto|GB|off)", file=sys.stderr)
        return fcache

    @property
    def chain_name(self) -> str:
        """What the replayed tau decodes: "chain-K" (EAGLE-3) or "block-B" (DFlash, B-1 drafts a round)."""
        return f"block-{self.K + 1}" if self.cfg.method == "dflash" else f"chain-{self.K}"

    # ------------------------------------------------------------------------------------------ data position
    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def pos(self) -> int:
        """The step within the epoch that runs next (loader.pos)."""
        return self.loader.pos

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """This rank's steps of `epoch`, each a list of grad_accum micro-batches (sample indices)."""
        return self.loader.plan(epoch)

    def next_batch(self) -> list[list[int]]:
        """The micro-batches of the step at the data position (epoch, pos)."""
        return self.loader.next_batch()

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """What RUN/checkpoints/step-N/state.pt holds: the full drafter (export keys) and optimizer, the scheduler,
        the step, the loader's state (data position), the config identity and the world size. Every rank calls it
        (FSDP2 gathers); tensors may share storage with the live ones, so save or copy before the next step."""
        m, o = dist.full_state_dict(self.module, self.optim, self.cfg.fsdp)
        return {"model": {k.removeprefix("drafter."): v for k, v in m.items()}, "optimizer": o,
                "scheduler": self.sched.state_dict(), "step": self.step, "data": self.loader.state_dict(),
                "config": self.cfg.identity(), "world_size": self.world}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(): drafter, optimizer, scheduler, step and data position. The RNG states are
        the checkpoint's own files (checkpoint.set_rng_state); config and world size are checked by _restore."""
        model = {f"drafter.{k}": v for k, v in state["model"].items()}
        dist.load_full_state_dict(self.module, self.optim, model, state["optimizer"], self.cfg.fsdp)
        self.sched.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.loader.load_state_dict(state["data"])

    def _restore(self) -> None:
        """--resume from the latest checkpoint (same config and world size), else start metrics.jsonl over."""
        run, metrics = self.run, self.run / "metrics.jsonl"
        if self.cfg.resume and (last := ckpt.latest_checkpoint(run)) is not None:
            state, rng = ckpt.load_checkpoint(last, rank=self.rank)
            check_same({**state["config"], "world_size": state["world_size"]},
                       {**self.cfg.identity(), "world_size": self.world}, what="training configuration",
                       where=str(last))
            self.load_state_dict(state)
            ckpt.set_rng_state(rng)
            if self.rank == 0:
                truncate_metrics(metrics, self.step)
        elif self.rank == 0 and metrics.exists():
            metrics.unlink()
        if self.rank == 0:
            write_manifest(run, self._manifest("running"))
        dist.barrier()

    def save_checkpoint(self) -> None:
        """RUN/checkpoints/step-N at the current step (atomic; every rank writes its RNG state)."""
        self.finite.check()
        state = self.state_dict()
        ckpt.save_checkpoint(self.run, self.step, state if self.rank == 0 else None, rank=self.rank,
                             barrier=dist.barrier, keep=self.cfg.keep_checkpoints)

    # ------------------------------------------------------------------------------------------ steps
    def train_step(self, batch: list[list[int]], sync: bool = True, host: list | None = None
                   ) -> tuple[dict | None, float, float | None]:
        """One optimizer step over `batch` (this rank's micro-batches); advances step, data position and tokens seen.
        Returns (the step's train summary over all ranks, the lr it used, the gradient norm before clipping).
        `host`: the micro-batches' _host_batch() results when prefetched, else they are made here (the seconds
        spent on them add to data_wait_s).

        With sync=False nothing is read back from the device (summary and norm are None), so the host can queue
        the next step while this one runs; the NaN/Inf checks of such steps are read at the next finite.check()
        (every synced step, eval, checkpoint and the end), before anything is evaluated or saved."""
        cfg, model = self.cfg, self.model
        sums = Sums(self.K, self.device)
        step = self.step + 1
        for a, idx in enumerate(batch):
            if host is None:
                t0 = time.perf_counter()
                h = self._host_batch(idx)
                self.data_wait_s += time.perf_counter() - t0
            b, n_tok, n_loss = self._features(idx, host[a] if host is not None else h)
            self.finite.watch(step, "features", b.ids, nonfinite_flags(b))
            known = self._known_targets(idx, b.input_ids)
            with dist.sync_grads(model, last=a == len(batch) - 1):
                with self.amp:
                    lmask = b.valid if cfg.loss_on == "all" else b.loss_mask
                    o = TTTOutput(*model(b.input_ids, lmask, b.valid, b.aux, b.final, self.embed_w, self.lm_w,
                                         b.segment_ids, b.position_ids, n_loss, known))
                if known is None and self.target_ids is not None:
                    for r, i in enumerate(idx):
                        self.target_ids[i] = o.target_ids[r, :self.source.lengths[i]].to(torch.int32)
                self.finite.watch(step, "loss", b.ids, ~torch.isfinite(o.loss.detach()))
                (o.loss / len(batch)).backward()
            sums.add(o, n_tok)
        gnorm = nn.utils.clip_grad_norm_(self.params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        self.finite.watch(step, "gradient norm", [self.source.ids[j] for idx in batch for j in idx],
                          ~torch.isfinite(gnorm))
        lr = self.sched.get_last_lr()[0]
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad(set_to_none=True)
        self.loader.advance()
        self.step = step
        if not sync:
            return None, lr, None
        self.finite.check()
        return sums.all_reduce().summary(), lr, float(gnorm)

    def _known_targets(self, idx: list[int], input_ids: torch.Tensor) -> torch.Tensor | None:
        """(B, T) target argmax of the micro-batch's samples from their earlier passes, or None (not all seen)."""
        if self.target_ids is None or any(i not in self.target_ids for i in idx):
            return None
        out = torch.zeros(input_ids.shape, dtype=torch.long)                    # (B, T)
        for r, i in enumerate(idx):
            out[r, :self.source.lengths[i]] = self.target_ids[i]
        return out.to(input_ids.device)

    def evaluate(self) -> dict:
        """Token-weighted TTT metrics, the mean alpha per step (whatever the loss) and the frequency baseline on the
        held-out split ({} when there is none)."""
        self.finite.check()
        if not self.eval_idx:
            return {}
        cfg, rank, world, packed = self.cfg, self.rank, self.world, self.packed
        self.model.eval()
        sums = Sums(self.K, self.device)
        by_len = sorted(self.eval_idx, key=lambda i: self.source.lengths[i])
        batches = (group_packed(by_len, self.source.lengths, *packed) if packed
                   else group(by_len, self.source.lengths, cfg.batch_tokens))
        # FSDP2 forwards are collective: every rank runs the same number (extra ones are discarded).
        rounds = math.ceil(len(batches) / world) if cfg.fsdp else len(batches[rank::world])
        jobs = ((j, batches[(j * world + rank) % len(batches)]) for j in range(rounds))
        pre = (Prefetcher(jobs, self._host_batch, name="eyas-prefetch-eval", device=self.device) if cfg.prefetch
               else None)
        with torch.no_grad(), (pre or contextlib.nullcontext()):
            for j in range(rounds):
                k = j * world + rank
                idx = batches[k % len(batches)]
                b, _, n_loss = self._features(idx, pre.get(j) if pre else None)  # n_loss bounds the counted positions
                with self.amp:  # DDP: the plain module (ranks may run different numbers of eval batches)
                    o = TTTOutput(*self.module(b.input_ids, b.loss_mask, b.valid, b.aux, b.final, self.embed_w,
                                               self.lm_w, b.segment_ids, b.position_ids, n_loss, None, True))
                    base = frequency_baseline(b.input_ids, b.loss_mask, b.valid, b.final, self.lm_w,
                                              self.vocab.t2d.to(self.device), self.top_id)
                if k < len(batches):
                    sums.add(o, sum(self.source.lengths[i] for i in batches[k]), base,
                             rounds=round_counts(o.accept_len, b.loss_mask, b.valid, b.segment_ids, self.K))
        self.model.train()
        return sums.all_reduce().summary(token_weighted=True)

    def _host_batch(self, idx: list[int]):
        """(the collated micro-batch on the host, pinned for the copy when reading a store for CUDA; each row's
        valid count; its count of loss positions). Reads only the source: the prefetch thread runs it."""
        pin = self.device.type == "cuda" and not self.cfg.online
        b = self.source.collate(idx, pin=True) if pin else self.source.collate(idx)
        lengths = b.valid.sum(-1).tolist()                                     # on the CPU: no host sync
        n_loss = int((b.valid if self.cfg.loss_on == "all" else b.loss_mask & b.valid).sum())
        return b, lengths, n_loss

    def _features(self, idx: list[int], host=None):
        """(the micro-batch on the device, with features and packed as configured; its token count; its count of
        loss positions, an upper bound on what the TTT loss counts). Counts are taken on the host, so nothing here
        waits for the device. `host`: its _host_batch(), when already made."""
        b, lengths, n_loss = host if host is not None else self._host_batch(idx)
        b = b.to(self.device)
        if self.cfg.online:
            b = online_features(self.fcache, self.target, b, idx, lengths,
                                sub_tokens=self.cfg.batch_tokens if self.packed else None)
        return (pack(b, *self.packed, lengths=lengths) if self.packed else b), sum(lengths), n_loss

    # ------------------------------------------------------------------------------------------- loop
    def train(self) -> dict:
        """Step to the last step: metrics, evals (every eval_every steps, or at each epoch's end when it is 0; and
        after the last step) and checkpoints; then write the drafter and the complete manifest.
        Returns {step, train, eval, vocab_coverage}. With cfg.prefetch a thread makes the next step's input while
        this one runs (train/prefetch.py); it is stopped and joined on any exit, KeyboardInterrupt included."""
        pre = (Prefetcher(self.loader.upcoming(self.epoch, self.pos, self.total - self.step),
                          lambda batch: [self._host_batch(idx) for idx in batch], device=self.device)
               if self.cfg.prefetch else None)
        with pre or contextlib.nullcontext():
            return self._train(pre)

    def _train(self, pre: Prefetcher | None) -> dict:
        """train()'s loop; `pre` hands it each step's host batches, else they are made in the step."""
        cfg = self.cfg
        sink = MetricsSink(self.run, enabled=self.rank == 0, total_steps=self.total, start_step=self.step,
                           progress=cfg.progress)
        last_eval: dict = {}
        train_summary: dict = {}
        self.model.train()
        waited = self.data_wait_s
        t_loop, first_step_s = time.perf_counter(), None
        while self.step < self.total:
            n = self.loader.tokens_of_step(self.epoch, self.pos)
            logged = (self.step + 1) % cfg.log_every == 0 or self.step + 1 == self.total
            host = None
            if pre is not None:
                w0 = pre.wait_s
                host = pre.get((self.epoch, self.pos))
                self.data_wait_s += pre.wait_s - w0
            summary, lr, gnorm = self.train_step(self.next_batch(), sync=logged, host=host)   # others: no read-back
            step = self.step
            if first_step_s is None:  # the first step of this process: its compiles and the first features
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                first_step_s = time.perf_counter() - t_loop
                if self.rank == 0:
                    print(f"eyas train: set-up {self.setup_s:.1f} s, first step {first_step_s:.1f} s (compiles "
                          f"included)", file=sys.stderr)
            rate = sink.step(n, summary and {"loss": f"{summary['loss']:.3f}", "acc0": f"{summary['acc_k'][0]:.3f}"})
            if logged:
                train_summary = summary
                sink.log({"step": step, "split": "train", "epoch": self.epoch, "tokens_seen": self.loader.seen,
                          "lr": lr, "grad_norm": gnorm, "tokens_per_s": rate, "data_wait_s": self.data_wait_s - waited,
                          **train_summary})
                waited = self.data_wait_s
            end_of_epoch = self.loader.end_of_epoch
            # held-out: a fixed interval when one is set (epoch-end evals on top of it cost the gpu preset a large
            # share of its training time), else each epoch's end
            due = step % cfg.eval_every == 0 if cfg.eval_every else end_of_epoch
            if due or step == self.total:
                last_eval = self._logged_eval(sink, step)
            if end_of_epoch:
                self.loader.next_epoch()
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == self.total:
                self.save_checkpoint()
        sink.close()
        self.finite.check()
        if self.fcache is not None:  # its memory back for what runs next in this process (eyas run's bench)
            self.fcache.release()
        result = {"step": self.step, "train": train_summary, "eval": last_eval, "vocab_coverage": self.vocab.coverage}
        self._write_drafter(result, first_step_s)
        return result

    def _logged_eval(self, sink: MetricsSink, step: int) -> dict:
        """evaluate(), its record in the metrics and its line under the progress bar."""
        ev = self.evaluate()
        if ev:
            sink.log({"step": step, "split": "eval", "epoch": self.epoch, "tokens_seen": self.loader.seen, **ev})
            sink.note(f"eval @ step {step}: acc_0 {ev['acc_k'][0]:.3f} (frequency baseline "
                      f"{ev.get('baseline_acc_0', float('nan')):.3f}), tau_est {ev['tau_est']:.2f}, replayed "
                      f"{self.chain_name} tau {ev.get('round_tau_by_chain', [float('nan')])[-1]:.2f} (first replies "
                      f"{ev.get('round_tau_first_by_chain', [float('nan')])[-1]:.2f})"
                      + (f", alpha_0 {ev['alpha_k'][0]:.3f}" if "alpha_k" in ev else ""))
        return ev

    def _write_drafter(self, result: dict, first_step_s: float | None) -> None:
        """RUN/drafter and the complete manifest with `result` (rank 0; every rank gathers the weights)."""
        cfg = self.cfg
        m, _ = dist.full_state_dict(self.module, None, cfg.fsdp)
        startup = {"setup_s": round(self.setup_s, 3),
                   "first_step_s": None if first_step_s is None else round(first_step_s, 3)}
        if self.rank == 0:
            final = (DFlashDrafter if cfg.method == "dflash" else Eagle3Drafter)(self.dcfg)
            final.load_state_dict({k.removeprefix("drafter."): v for k, v in m.items()})
            save_drafter(final, self.run / "drafter", meta={"target": self.target.fingerprint})
            write_manifest(self.run, {**self._manifest("complete"), "result": result, "startup": startup})
        dist.barrier()

    def _manifest(self, status: str) -> dict:
        cfg = self.cfg
        return {"kind": KIND, "version": ckpt.VERSION, "status": status, "config": cfg.to_dict(),
                "config_identity": cfg.identity(),
                "target": self.target.fingerprint, "source": self.ref, "drafter": self.dcfg.to_dict(),
                "counts": {"train_samples": len(self.train_idx), "eval_samples": len(self.eval_idx)},
                "world_size": self.world, "total_steps": self.total,
                "vocab": {"size": self.vocab.size, "coverage": self.vocab.coverage},
                "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
