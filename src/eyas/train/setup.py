"""Set-up of a training run, in the order Trainer.__init__ calls it: the run directory's check, the data source and
its target, the draft vocabulary, the drafter's head (or --init's), the learning-rate schedule, and last the run
directory itself, so that a refusal at any step leaves nothing behind.

The ranks and the DDP / FSDP2 wrap are train/dist.py's; the training loop itself is train/trainer.py's.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch

import eyas.target  # load_target looked up at call time: tests patch it
from eyas.data.chat import TemplateError, first_turn_framing
from eyas.data.prepare import check_max_len
from eyas.data.prepared import PreparedData
from eyas.errors import EyasError
from eyas.manifest import MANIFEST, atomic_write_bytes, check_same, check_target, read_manifest
from eyas.model.dflash import DFlashConfig, DFlashDrafter, default_mask_token
from eyas.model.drafter import DrafterConfig
from eyas.model.vocab import DraftVocab, build_draft_vocab, save_draft_vocab
from eyas.store.reader import Store
from eyas.target.meta import open_target_meta
from eyas.train import checkpoint as ckpt
from eyas.train.config import TrainConfig
from eyas.train.data import PreparedSource, StoreSource

KIND = "train"
"""The manifest kind of a training run directory."""


def refuse_run_dir(cfg: TrainConfig, run: Path) -> None:
    """Refuse a --out that is not a fresh or resumable training run. Reads only: the trainer calls it before it opens
    the target, so a refusal there (or of the target) leaves nothing behind."""
    if run.exists() and not run.is_dir():
        raise EyasError(f"{run}: exists and is not a directory")
    if (run / MANIFEST).exists():
        old = read_manifest(run)
        if old.get("kind") != KIND:
            raise EyasError(f"{run}: holds a {old.get('kind')!r} directory, not a training run")
        if cfg.resume:
            if (v := old.get("version", 1)) != ckpt.VERSION:
                raise EyasError(f"{run / MANIFEST}: a training run of version {v} (an older eyas's), this eyas resumes "
                                f"version {ckpt.VERSION}; train into another --out, or delete {run} to start again")
            check_same(old["config_identity"], cfg.identity(), what="training configuration", where=str(run))
        elif ckpt.list_checkpoints(run):
            raise EyasError(f"{run}: already holds a run with checkpoints; pass --resume or choose another --out")
    elif run.is_dir() and any(run.iterdir()) and not _killed_early(run):
        raise EyasError(f"{run}: not empty and not an eyas training run; refusing to write into it")


def _killed_early(run: Path) -> bool:
    """A run killed before its first manifest leaves only the draft vocabulary (and temp files)."""
    return all(p.name == "vocab" or (p.name.startswith(".") and ".tmp-" in p.name) for p in run.iterdir())


def check_run_dir(cfg: TrainConfig, run: Path) -> None:
    """refuse_run_dir, then clear what a run killed before its first manifest left behind and create the directory.
    Rank 0 only, once everything else of the set-up has been checked."""
    refuse_run_dir(cfg, run)
    if not (run / MANIFEST).exists() and run.is_dir():
        shutil.rmtree(run / "vocab", ignore_errors=True)
        for p in run.glob(".*.tmp-*"):
            p.unlink(missing_ok=True)
    run.mkdir(parents=True, exist_ok=True)


def open_source(cfg: TrainConfig, target, device: torch.device):
    """(source, target, reference dict for the manifest). Refuses a store/target mismatch."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.online:
        if target is None:
            target = eyas.target.load_target(cfg.target, device=device, dtype=dtype,
                                             trust_remote_code=cfg.trust_remote_code)
        data = PreparedData(cfg.data, target=target)
        ref = {"data": str(Path(cfg.data).resolve()), "data_manifest": data.manifest.get("config")}
        check_max_len_fits(cfg, target)
        return PreparedSource(data, max_len=cfg.max_len), target, ref

    store = Store(cfg.store)
    if target is None:
        spec = cfg.target or store.manifest.get("config", {}).get("target") or store.fingerprint.get("identity")
        # Offline needs only the embedding, LM head and final norm, read from their shards on the CPU.
        target = open_target_meta(spec, dtype=dtype, aux_layer_ids=store.aux_layer_ids,
                                  trust_remote_code=cfg.trust_remote_code)
    warning = check_target(store.fingerprint, target.fingerprint, where=str(store.path),
                           allow_mismatch=cfg.allow_target_mismatch)
    if tuple(store.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise EyasError(f"{store.path}: store aux layers {list(store.aux_layer_ids)} != the target's "
                        f"{list(target.aux_layer_ids)}")
    if store.hidden_size != target.hidden_size:
        raise EyasError(f"{store.path}: store hidden size {store.hidden_size} != the target's {target.hidden_size}")
    ref = {"store": str(Path(cfg.store).resolve()), "store_samples": len(store), "store_dtype": store.store_dtype,
           "aux_layer_ids": list(store.aux_layer_ids), **({"target_mismatch": warning} if warning else {})}
    check_max_len_fits(cfg, target)
    return StoreSource(store, max_len=cfg.max_len, feature_dtype=dtype), target, ref


def check_max_len_fits(cfg: TrainConfig, target) -> None:
    """Refuse a --max-len that cannot hold the target's chat-template framing of a first turn (its system prompt and
    headers) plus a reply token, the rule prepare applies: every sample would be cut before its first reply. A target
    without a (working) chat template is not checked."""
    tok = getattr(target, "tokenizer", None)
    if tok is None or not getattr(tok, "chat_template", None):
        return
    try:
        first_turn_framing(tok)
    except TemplateError:
        return
    check_max_len(tok, cfg.max_len, f"target {getattr(target, 'name', None) or cfg.target}")


def build_vocab(cfg: TrainConfig, source, train_idx, V: int, init_vocab, *, announce: bool = True):
    """(draft vocabulary, the draft id most common in training, its summary for RUN/vocab/) from the loss-masked
    tokens of `train_idx`, or --init's vocabulary with its coverage of them. Writes nothing (write_vocab does);
    `announce`: say on stderr how many samples add no loss (rank 0)."""
    counts = torch.zeros(V, dtype=torch.int64)
    untrainable = []  # samples with no loss-masked token within max_len: they add no loss
    for i in train_idx:
        ids, mask = source.tokens(i)
        picked = ids[mask]
        if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= V):
            raise EyasError(f"{source.where}: sample {source.ids[i]!r} has a token id outside [0, {V})")
        if not picked.numel():
            untrainable.append(source.ids[i])
        counts += torch.bincount(picked, minlength=V)
    if int(counts.sum()) == 0:
        raise EyasError(f"{source.where}: the training split has no trainable (loss-masked) tokens within the "
                        f"first --max-len {cfg.max_len} tokens of its {len(train_idx)} samples")
    if untrainable and announce:
        print(f"eyas train: {len(untrainable)} of {len(train_idx)} training samples of {source.where} have no "
              f"trainable token within --max-len {cfg.max_len} (first: {untrainable[0]!r}); they add no loss",
              file=sys.stderr)
    if init_vocab is not None:
        d2t, t2d = init_vocab
        tok = torch.arange(d2t.numel()) + d2t
        vocab = DraftVocab(token_ids=tok, d2t=d2t, t2d=t2d, coverage=float(counts[tok].sum()) / int(counts.sum()))
    else:
        # for_device filled a None; DFlash drafts the whole vocabulary through the target's head
        vocab = build_draft_vocab(counts, V if cfg.method == "dflash" else min(cfg.draft_vocab, V))
    top_draft = int(vocab.token_ids[counts[vocab.token_ids].argmax()])
    summary = {"size": vocab.size, "vocab_size": V, "coverage": vocab.coverage, "most_common_id": top_draft,
               "trainable_tokens": int(counts.sum()), "split": "train"}
    return vocab, top_draft, summary


def write_vocab(run: Path, vocab, summary: dict) -> None:
    """RUN/vocab/: draft_vocab.safetensors and summary.json (rank 0)."""
    (run / "vocab").mkdir(parents=True, exist_ok=True)
    save_draft_vocab(vocab, run / "vocab" / "draft_vocab.safetensors")
    atomic_write_bytes(run / "vocab" / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())


def run_drafter_config(cfg: TrainConfig, target, init_config=None):
    """The DrafterConfig a run of `cfg` (resolved for its device: TrainConfig.for_device) trains on `target`: sizes
    from the target, a draft vocabulary of min(draft_vocab, V) ids (build_vocab's), or --init's (`init_config`).
    With --method dflash the DFlashConfig: depth, block and mask token as set or derived (model/dflash.py), the
    context from the target's aux layers, or --init's config.
    The Trainer builds its drafter from it; `eyas run` warms the bench's compiled graphs for it while training runs."""
    if cfg.method == "dflash":
        if init_config is not None:
            return init_config
        mask = (cfg.mask_token_id if cfg.mask_token_id is not None
                else default_mask_token(getattr(target, "tokenizer", None), target.vocab_size))
        if mask >= target.vocab_size:
            raise EyasError(f"--mask-token-id {mask} is outside the target's vocabulary (0..{target.vocab_size - 1})")
        return DFlashConfig.from_target(target.config, aux_layer_ids=target.aux_layer_ids, mask_token_id=mask,
                                        num_layers=cfg.dflash_layers, block_size=cfg.block_size,
                                        intermediate_size=cfg.intermediate_size)
    size = init_config.draft_vocab_size if init_config is not None else min(cfg.draft_vocab, target.vocab_size)
    return DrafterConfig.from_target(target.config, draft_vocab_size=size, aux_layer_ids=target.aux_layer_ids,
                                     intermediate_size=cfg.intermediate_size, norm_before_fc=cfg.norm_before_fc)


POSITION_BOUND = ("max_position_embeddings",)
"""DrafterConfig fields that only bound positions: nothing the drafter computes reads them (rope_inv_freq takes the
theta and the scaling's own fields), so an --init head may differ in them and the run's value is kept (a published
Kimi-K2 head says 131072, a Kimi-K2.5 run 262144)."""


def check_init_config(init, run, where: str) -> str | None:
    """Refuse an --init drafter config that differs from the run's in a field that changes the weights' shapes or
    meaning (sizes, heads, eps, RoPE, vocabulary, aux layers), naming each; one that differs only in POSITION_BOUND
    fields is accepted, and the returned line says which value the run keeps (None: no difference)."""
    a, b = init.to_dict(), run.to_dict()
    check_same({k: v for k, v in a.items() if k not in POSITION_BOUND},
               {k: v for k, v in b.items() if k not in POSITION_BOUND}, what="drafter config of --init", where=where)
    moved = [f"{k} {a[k]} -> {b[k]}" for k in POSITION_BOUND if a[k] != b[k]]
    return (f"eyas train: --init {where}: {', '.join(moved)}, the run's (it only bounds positions; the drafter's "
            f"plain RoPE does not read it)") if moved else None


def check_init_kind(drafter, cfg: TrainConfig) -> None:
    """Refuse an --init drafter of the other family (an EAGLE-3 head for a DFlash run, or the reverse)."""
    kind = "dflash" if isinstance(drafter, DFlashDrafter) else "eagle3"
    if kind != cfg.method:
        raise EyasError(f"--init {cfg.init}: a {'DFlash' if kind == 'dflash' else 'EAGLE-3'} drafter, but this run "
                        f"trains --method {cfg.method}")


@torch.no_grad()
def init_head_from_target(drafter, target) -> None:
    """Start the drafter's output side as the target's: final norm and the LM-head rows of the draft vocabulary.

    The drafter's last hidden state then lives in the target's output space from step 0, which is where
    it has to end up; everything else keeps its random init."""
    rows = drafter.token_ids.to(target.lm_head.weight.device)
    drafter.lm_head.weight.copy_(target.lm_head.weight[rows].float())
    drafter.norm.weight.copy_(target.final_norm.weight.float())


def schedule(cfg: TrainConfig, total: int):
    """LambdaLR factor at each step: linear warm-up over warmup_ratio of `total` steps, then cosine to min_lr_ratio."""
    warm = int(cfg.warmup_ratio * total)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        p = min(1.0, (step - warm) / max(1, total - warm))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return f
