"""`eyas train`: parse arguments into a TrainConfig and call run_train."""

from __future__ import annotations

import json

from eyas.errors import EyasError
from eyas.knobs import FROM_FLAG, FROM_STORE, add_command, add_flags, announce_target, from_args
from eyas.manifest import read_manifest
from eyas.train.config import CHOICES, DEVICE_DEFAULTS, TrainConfig
from eyas.train.trainer import run_train


def register(subparsers) -> None:
    p = add_command(subparsers, "train", main,
                    help="train an EAGLE-3 or DFlash drafter (offline from a store, or online)")
    cuda, cpu = DEVICE_DEFAULTS["cuda"], DEVICE_DEFAULTS["cpu"]
    # Help texts in a user's words where the field's docstring points into the source.
    special = {n: {"choices": list(c)} for n, c in CHOICES.items()}
    special.update(
        target={"help": "Target model (online: it runs in each step; offline: its embedding, LM head and final norm; "
                        "default: the store's target)"},
        ttt_steps={"help": f"K, unrolled draft steps of training-time test (default: {cuda['ttt_steps']} on CUDA, "
                           f"{cpu['ttt_steps']} on the CPU)"},
        draft_vocab={"help": f"Draft vocabulary size (default: {cuda['draft_vocab']} on CUDA, {cpu['draft_vocab']} on "
                             f"the CPU, at most the target's vocabulary; a larger value is refused)"},
        attention={"choices": list(CHOICES["attention"]),
                   "help": "TTT attention: 'flex' (block-sparse flex attention, CUDA), 'blocks' (fused step 0 + "
                           "diagonals, CPU), 'dense' (explicit mask) or 'auto' (flex on CUDA, blocks on the CPU) "
                           "(default: %(default)s)"},
        deterministic={"help": "Deterministic torch algorithms and fp32 math (no autocast): bitwise-repeatable runs."},
        fsdp={"help": "Shard the drafter with FSDP2 instead of DDP (under torchrun)."},
        feature_cache={"help": "Online: keep each sample's target states from its first forward for later epochs and "
                               "evals: 'auto' (on the device up to the room left after a margin, the rest in pinned "
                               "host memory up to the host's room), a budget in GB (10^9 bytes), or 'off' (the target "
                               "runs every step) (default: %(default)s)"},
        block_size={"help": "DFlash: tokens per block, the last committed token and --block-size - 1 mask slots "
                            "(default: 16, 8 for DeepSeek-V3 / Kimi-class targets)"},
        dflash_layers={"help": "DFlash: decoder layers (default: the target's layers / 8, 1 to 5)"},
        lk_eta={"help": "--loss lk_lambda's decay eta: the CE's weight is exp(-eta * the step's mean alpha over the "
                        "micro-batch) (the paper's eta; 0 gives the plain CE) (default: %(default)s)"},
        block_gamma={"help": "DFlash: slot k's loss weight is exp(-(k-1)/gamma) with gamma this value (default: 7 "
                             "for blocks of 16 and up, 4 below)"},
        loss={"choices": list(CHOICES["loss"]),
              "help": "Per-step TTT loss: 'ce' (soft cross-entropy against the target's draft-vocab law), 'lk_alpha' "
                      "(mean of -log alpha, alpha = the sum over the vocabulary of min(p, q), the chance that the "
                      "target accepts a token sampled from the drafter) or 'lk_lambda' (w CE + (1 - w)(1 - mean "
                      "alpha), w = exp(-eta * mean alpha), eta from --lk-eta): the LK losses, arXiv 2602.23881 "
                      "(default: %(default)s)"},
        progress={"help": "no progress bar"})
    add_flags(p, TrainConfig, ["method"], **special)
    data = p.add_argument_group("data")
    src = data.add_mutually_exclusive_group(required=True)
    add_flags(src, TrainConfig, ["store", "data"], **special)
    add_flags(data, TrainConfig, ["max_len", "pack", "eval_fraction", "feature_cache", "prefetch"], **special)
    add_flags(p.add_argument_group("target"), TrainConfig, ["target", "device", "allow_target_mismatch",
                                                           "trust_remote_code"], **special)
    add_flags(p.add_argument_group("drafter"), TrainConfig, ["init", "init_from_target", "draft_vocab",
                                                            "intermediate_size", "norm_before_fc"], **special)
    training = p.add_argument_group("training")
    n = training.add_mutually_exclusive_group()
    add_flags(n, TrainConfig, ["epochs", "steps"], **special)
    add_flags(training, TrainConfig, ["lr", "warmup_ratio", "batch_tokens", "grad_accum", "ttt_steps", "chunk_size",
                                      "loss", "lk_eta", "loss_on", "attention", "autocast", "compile", "fsdp", "seed",
                                      "deterministic"], **special)
    add_flags(p.add_argument_group("output"), TrainConfig, ["out", "resume", "eval_every", "checkpoint_every",
                                                           "progress"], **special)
    block = p.add_argument_group("DFlash (--method dflash)")
    add_flags(block, TrainConfig, ["block_size", "dflash_layers", "mask_token_id", "anchors", "block_gamma", "labels"],
              **special)


def store_target(store: str) -> str | None:
    """The target an offline run without --target opens: the spec the store's capture loaded, else the name in its
    fingerprint (None where the store cannot be read: training then says why)."""
    try:
        manifest = read_manifest(store)
    except EyasError:
        return None
    return (manifest.get("config") or {}).get("target") or (manifest.get("target") or {}).get("identity")


def main(args) -> int:
    """Train an EAGLE-3 drafter, or a DFlash block drafter with --method dflash. Offline: --store STORE. Online:
    --target T --data PREPARED (the target runs inside each step). Under torchrun every rank trains on its own shard
    (DDP, or FSDP2 with --fsdp)."""
    try:
        cfg = from_args(TrainConfig, args)
    except ValueError as e:
        raise EyasError(str(e)) from e
    if cfg.target:
        announce_target("train", cfg.target, FROM_FLAG)
    elif name := store_target(cfg.store):
        announce_target("train", name, FROM_STORE)
    result = run_train(cfg)
    ev = result.get("eval") or {}
    line = {"step": result["step"], "train_loss": round(result["train"]["loss"], 4),
            "vocab_coverage": round(result["vocab_coverage"], 4)}
    if ev:
        line.update(eval_acc_k=[round(a, 4) for a in ev["acc_k"]],
                    eval_cond_acc_k=[round(a, 4) for a in ev["cond_acc_k"]],
                    baseline_acc_0=round(ev.get("baseline_acc_0", float("nan")), 4), tau_est=round(ev["tau_est"], 3))
        if "alpha_k" in ev:
            line["eval_alpha_k"] = [round(a, 4) for a in ev["alpha_k"]]
    print(json.dumps(line))
    return 0
