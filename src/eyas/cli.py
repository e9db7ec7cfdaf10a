"""The `eyas` command: parse arguments and call the stage's library function. Nothing else."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from eyas import __version__
from eyas.errors import EyasError
from eyas.recipes import named_recipe, stage_defaults

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
# The stage commands that take --recipe: the recipe's table of the same name sets their defaults.
RECIPE_STAGES = ("prepare", "capture", "train", "bench")
RECIPE_HELP = ("a recipe (a preset, a family recipe such as deepseek-v3, or a TOML file): its {0} table sets this "
               "command's defaults, and a flag given here wins over it")


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
        if name in RECIPE_STAGES:
            group = sub.choices[name].add_argument_group("recipe")
            group.add_argument("--recipe", metavar="NAME|FILE",
                               help=RECIPE_HELP.format("[[bench]]" if name == "bench" else f"[{name}]"))
    parser.stages = sub.choices  # name -> its subparser, for --recipe
    return parser


def with_recipe(parser: argparse.ArgumentParser, argv: list[str] | None,
                args: argparse.Namespace) -> argparse.Namespace:
    """The stage's arguments parsed again over its recipe table's values (flags given still win), the values it
    set printed to stderr."""
    recipe, stage = named_recipe(args.recipe), parser.stages[args.command]
    table = stage_defaults(recipe, args.command)
    if args.command == "train":  # the family trained: a --method flag, else the recipe's
        before = {k: stage.get_default(k) for k in table}
        stage.set_defaults(**table)
        table = stage_defaults(recipe, "train", method=parser.parse_args(argv).method)
        stage.set_defaults(**{k: v for k, v in before.items() if k not in table})  # the other family's keys: back
    stage.set_defaults(**table)
    args = parser.parse_args(argv)
    shown = ", ".join(f"{k}={v}" if getattr(args, k) == v else f"{k}={getattr(args, k)} (the flag; the recipe: {v})"
                      for k, v in table.items())
    print(f"eyas {args.command}: recipe {recipe.name}: {shown or 'sets nothing for this stage'}", file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.show_version:
        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command in RECIPE_STAGES and args.recipe:
            args = with_recipe(parser, argv, args)
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
