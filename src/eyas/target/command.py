"""`eyas target slim SRC DST`: the weightless copy of a target that eyas's stages read (target/slim.py)."""

from __future__ import annotations

from eyas.target.slim import slim_copy


def register(subparsers) -> None:
    p = subparsers.add_parser("target", help="prepare a target directory for eyas",
                              description="Tools for target model directories.")
    sub = p.add_subparsers(dest="target_cmd", required=True)
    s = sub.add_parser("slim", help="copy a target without the weights eyas never reads",
                       description="Copy SRC to DST with its config, tokenizer files (and their code), the weight "
                                   "index and only the shards that hold the embedding, the final norm and the LM "
                                   "head. Every eyas stage that does not run the target's forward (prepare with a "
                                   "server, capture from a server, offline train, export, bench --engine) takes "
                                   "DST as --target, with the same fingerprint as SRC.")
    s.add_argument("src", help="the full target directory (a safetensors checkpoint with an index)")
    s.add_argument("dst", help="the copy to write (must not exist, or be empty)")
    s.set_defaults(func=_slim)


def _slim(args) -> int:
    r = slim_copy(args.src, args.dst)
    print(f"{args.dst}: {r['files']} files, {r['bytes'] / 1e9:.2f} GB (head shards: {', '.join(r['head_shards'])})")
    return 0
