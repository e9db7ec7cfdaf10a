"""`eyas store verify STORE` and `eyas store info STORE`."""

from __future__ import annotations

import json

from eyas.knobs import add_command
from eyas.store.reader import Store


def register(subparsers) -> None:
    p = subparsers.add_parser("store", help="inspect or verify a hidden-state store",
                              description="Inspect or verify a store of hidden states written by `eyas capture`.")
    sub = p.add_subparsers(dest="store_cmd", required=True)
    v = add_command(sub, "verify", _verify, help="check checksums, shapes and finiteness of every shard")
    v.add_argument("store", help="the store directory")
    v.add_argument("--allow-incomplete", action="store_true", help="also verify an interrupted store")
    i = add_command(sub, "info", _info, help="counts, bytes per token, layers")
    i.add_argument("store", help="the store directory")


def _verify(args) -> int:
    """Read every shard of a store and check its checksum, tensor shapes and that every value is finite."""
    report = Store(args.store, allow_incomplete=args.allow_incomplete).verify(progress=True)
    print(f"{args.store}: OK ({report['shards']} shards, {report['samples']} samples, {report['tokens']} tokens)")
    return 0


def _info(args) -> int:
    """Print a store's counts, bytes per token and captured layers as JSON."""
    print(json.dumps(Store(args.store, allow_incomplete=True).info(), indent=2))
    return 0
