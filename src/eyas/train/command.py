"""`eyas train`: parse arguments into a TrainConfig and call run_train."""

from __future__ import annotations

import json

from eyas.errors import EyasError


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train an EAGLE-3 drafter (offline from a store, or online)",
                              description="Train an EAGLE-3 drafter. Offline: --store STORE. Online: --target T "
                                          "--data PREPARED (the target runs inside each step). Under torchrun "
                                          "every rank trains on its own shard (DDP, or FSDP2 with --fsdp).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", help="hidden-state store (offline training)")
    src.add_argument("--data", help="prepared data directory (online training; needs --target)")
    p.add_argument("--target", help="target model (online; offline default: the store's target)")
    p.add_argument("--out", required=True, help="run directory")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--epochs", type=int, help="passes over the training split (default 1)")
    n.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--init", help="start from a saved drafter directory (weights and draft vocab)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per micro-batch, padded (default 4096)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--max-len", type=int, default=2048, help="truncate samples to this length (default 2048)")
    p.add_argument("--ttt-steps", type=int, help="unrolled draft steps K (default: 7 on CUDA, 3 on the CPU)")
    p.add_argument("--chunk-size", type=int, help="rows per chunk of the fused LM head + loss (default 4096)")
    p.add_argument("--draft-vocab", type=int, help="draft vocabulary size (default: 32000 on CUDA, 8192 on the CPU; capped at the target's)")
    p.add_argument("--attention", choices=["auto", "dense", "flex"], default="auto",
                   help="TTT attention: flex (block-sparse, CUDA), dense (explicit mask); auto = flex on CUDA")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="train although the store's or --init drafter's target differs (warning in the manifest)")
    p.add_argument("--compile", action="store_true", help="torch.compile the drafter's decoder layer")
    p.add_argument("--pack", choices=["auto", "on", "off"], default="auto",
                   help="pack samples into rows of --max-len tokens (fixed shapes); auto = on with CUDA")
    p.add_argument("--intermediate-size", type=int, help="drafter MLP width (default: the target's)")
    p.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto",
                   help="bf16 autocast: auto = on CUDA only; bf16 also on the CPU")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the drafter's norm and LM head from the target's (measured: slower to learn, see docs/LOG.md)")
    p.add_argument("--loss-on", choices=["assistant", "all"], default="assistant",
                   help="positions that train: the assistant loss mask, or all (prompts too; the labels are the "
                        "target's own distributions either way)")
    p.add_argument("--warmup-ratio", type=float, default=0.02, help="share of steps in warm-up (default 0.02)")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (default: each epoch end)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps (default: at the end)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true", help="deterministic algorithms (repeatable runs)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="held-out share for eval (default 0.05)")
    p.add_argument("--fsdp", action="store_true", help="shard the drafter with FSDP2 (torchrun, >= 2 ranks)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def main(args) -> int:
    from eyas.train.config import TrainConfig
    from eyas.train.trainer import run_train

    try:
        cfg = TrainConfig(out=args.out, store=args.store, data=args.data, target=args.target, epochs=args.epochs,
                          steps=args.steps, resume=args.resume, init=args.init, lr=args.lr,
                          batch_tokens=args.batch_tokens, grad_accum=args.grad_accum, max_len=args.max_len,
                          ttt_steps=args.ttt_steps, chunk_size=args.chunk_size, draft_vocab=args.draft_vocab,
                          attention=args.attention, pack=args.pack, compile=args.compile,
                          allow_target_mismatch=args.allow_target_mismatch,
                          intermediate_size=args.intermediate_size, init_from_target=args.init_from_target, loss_on=args.loss_on, autocast=args.autocast, warmup_ratio=args.warmup_ratio,
                          checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, device=args.device, seed=args.seed,
                          deterministic=args.deterministic, eval_fraction=args.eval_fraction, fsdp=args.fsdp,
                          progress=not args.no_progress)
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
    print(json.dumps(line))
    return 0
