"""The `eyas` command: parse arguments and call the stage's library function. Nothing else."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from eyas.errors import EyasError

# Each stage module exposes register(subparsers). Order = the pipeline.
STAGE_MODULES = [
    ("prepare", "eyas.data.command"),
    ("capture", "eyas.capture.command"),
    ("store", "eyas.store.command"),
    ("train", "eyas.train.command"),
    ("bench", "eyas.bench.command"),
    ("export", "eyas.export.command"),
    ("engine", "eyas.engines.command"),
    ("target", "eyas.target.command"),
    ("run", "eyas.run"),
]


def _not_implemented(name: str):
    def run(args) -> int:
        print(f"eyas {name}: not implemented yet in this version of eyas", file=sys.stderr)
        return 2
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas", description="Train speculative-decoding drafters (EAGLE-3, DFlash) for a target model: prepare "
                                 "-> capture -> train -> bench -> export, or all of them in one resumable `eyas run`.")
    # dest is not "version": a subcommand may have its own --version (engine launch-args: the engine's), and
    # argparse copies sub-namespace values over same-named top-level ones.
    parser.add_argument("--version", dest="show_version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in STAGE_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # a real import bug inside an implemented stage: let it surface
                raise
            p = sub.add_parser(name, help=f"{name} (not implemented yet)")
            p.set_defaults(func=_not_implemented(name))
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.show_version:
        from eyas import __version__
        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except EyasError as e:
        print(f"eyas {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eyas {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def leave(rc: int) -> None:
    """End the process with exit status rc. Under torchrun (WORLD_SIZE > 1) without interpreter teardown: after
    FSDP2, torch's DTensor caches still hold the device mesh and so the process group past destroy_process_group,
    and its gloo threads can abort a rank during teardown ("terminate called without an active exception", exit
    134 after a finished run; docs/LOG.md). Every file eyas writes is closed before its stage returns."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


def run() -> None:
    """The process entry of `eyas` and `python -m eyas`: main(), then leave()."""
    leave(main())


if __name__ == "__main__":
    run()
