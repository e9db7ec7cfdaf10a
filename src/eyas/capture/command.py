"""`eyas capture`: argparse wiring for run_capture."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import eyas.capture.capture  # run_capture looked up at call time: tests patch it
from eyas.capture.capture import CaptureConfig
from eyas.data.prepared import PreparedData
from eyas.engines.capture import add_engine_args, config_from_args, run_engine_capture, served_check
from eyas.errors import EyasError
from eyas.knobs import DEVICE_HELP, add_command, add_flags, announce_target, flag_or_default, from_args, resolve_device
from eyas.store.format import DTYPES
from eyas.target.dist import destroy_process_group, init_process_group
from eyas.target.layers import resolve_aux_layer_ids
from eyas.target.meta import read_config


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: expected comma-separated integers, e.g. 2,15,27")


def register(subparsers) -> None:
    p = add_command(subparsers, "capture", _main, help="store the target's aux + final hidden states for prepared data")
    special = dict(data={"required": True}, layers={"type": _layers}, dtype={"choices": list(DTYPES)},
                   device={"default": "auto", "help": DEVICE_HELP + "; cuda:LOCAL_RANK under torchrun (default: "
                                                                     "%(default)s)"})
    target = p.add_argument_group("target")
    add_flags(target, CaptureConfig, ["target", "device", "trust_remote_code"], **special)
    target.add_argument("--target-config", default=None,
                        help="with --engine: the served target's config.json or its directory (the layer count, "
                             "hidden and vocab size; no weights are read)")
    add_flags(p.add_argument_group("data"), CaptureConfig, ["data", "limit"], **special)
    add_flags(p.add_argument_group("capture"), CaptureConfig, ["layers", "dtype", "batch_tokens"], **special)
    add_flags(p.add_argument_group("output"), CaptureConfig, ["out", "overwrite", "shard_mb"], **special)

    add_engine_args(p)


def _engine_main(args) -> int:
    """`eyas capture --engine sglang|vllm`: the target runs in a server; only its config is read here."""
    if not args.target_config:
        raise EyasError("capture --engine needs --target-config CONFIG.json (the served model's config)")
    path = Path(args.target_config)
    _, raw = read_config(path / "config.json" if path.is_dir() else path)  # a wrapper's language model fields
    try:
        n, h, v = int(raw["num_hidden_layers"]), int(raw["hidden_size"]), int(raw["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise EyasError(f"{args.target_config}: missing num_hidden_layers/hidden_size/vocab_size ({e})") from None
    ids = resolve_aux_layer_ids(args.layers or None, n)
    check = served_check(args)                           # None with --no-check, else (preflight, run)
    m = run_engine_capture(config_from_args(args), aux_layer_ids=ids, hidden_size=h, vocab_size=v,
                           preflight=check and check[0])
    print(json.dumps({k: m.get(k) for k in ("complete", "num_samples", "num_tokens", "num_shards", "dtype")}))
    if not m.get("complete"):
        return 1
    return check[1]() if check else 0


def _main(args) -> int:
    """Run the target over a prepared directory and store, per sample, the hidden states of three of its layers and
    its final state: what offline training reads. In process (the target loads here) or through a running SGLang /
    vLLM server (--engine). Rerunning the same command resumes an interrupted capture."""
    if args.engine:
        return _engine_main(args)
    # The data are checked before the target loads, so a wrong --data fails at once, not after a model load; the
    # capture itself checks them again against the target.
    PreparedData(args.data)
    device = resolve_device(args.device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    owns = False
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            init_process_group("gloo")  # only for barriers; every rank writes its own shards
            owns = True
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    try:
        cfg = from_args(CaptureConfig, args, device=device)
    except ValueError as e:
        raise EyasError(f"capture: {e}") from None
    announce_target("capture", cfg.target, flag_or_default(cfg.target, CaptureConfig.target))
    m = eyas.capture.capture.run_capture(cfg)
    if owns:           # every rank is past run_capture's last barrier; a live gloo group at exit can abort the process
        destroy_process_group()
    keys = ("complete", "num_samples", "num_tokens", "num_shards", "bytes", "dtype")
    print(json.dumps({k: m[k] for k in keys}))
    return 0
