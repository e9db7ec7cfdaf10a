"""`eyas train`: parse arguments into a TrainConfig and call run_train."""

from __future__ import annotations

import json

from eyas.errors import EyasError
from eyas.knobs import add_flags, from_args


def register(subparsers) -> None:
    from eyas.train.config import CHOICES, TrainConfig

    p = subparsers.add_parser("train", help="train an EAGLE-3 or DFlash drafter (offline from a store, or online)",
                              description="Train an EAGLE-3 drafter, or a DFlash block drafter with --method dflash. "
                                          "Offline: --store STORE. Online: --target T --data PREPARED (the target "
                                          "runs inside each step). Under torchrun every rank trains on its own shard "
                                          "(DDP, or FSDP2 with --fsdp).")
    choices = {n: {"choices": list(c)} for n, c in CHOICES.items()}
    add_flags(p, TrainConfig, ["method"], **choices)
    src = p.add_mutually_exclusive_group(required=True)
    add_flags(src, TrainConfig, ["store", "data"])
    add_flags(p, TrainConfig, ["target", "out"])
    n = p.add_mutually_exclusive_group()
    add_flags(n, TrainConfig, ["epochs", "steps"])
    add_flags(p, TrainConfig, ["resume", "init", "lr", "batch_tokens", "grad_accum", "max_len", "ttt_steps",
                               "chunk_size", "draft_vocab", "attention", "allow_target_mismatch", "compile", "pack",
                               "intermediate_size", "norm_before_fc", "autocast", "init_from_target", "loss", "lk_eta",
                               "loss_on", "warmup_ratio", "trust_remote_code", "eval_every", "checkpoint_every", "device",
                               "seed", "deterministic", "eval_fraction", "fsdp", "progress", "feature_cache",
                               "prefetch"],
              progress={"help": "no progress bar"}, **choices)
    block = p.add_argument_group("DFlash (--method dflash)")
    add_flags(block, TrainConfig, ["block_size", "dflash_layers", "mask_token_id", "anchors", "block_gamma", "labels"],
              **choices)
    p.set_defaults(func=main)


def main(args) -> int:
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import run_train

    try:
        cfg = from_args(TrainConfig, args)
    except ValueError as e:
        raise EyasError(str(e)) from e
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
