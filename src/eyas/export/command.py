"""`eyas export`: argument parsing only; the work is eyas.export.export.run_export."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from eyas.export.export import run_export

    out = run_export(args.drafter, args.out, dtype=args.dtype, target_spec=args.target,
                     allow_target_mismatch=args.allow_target_mismatch, trust_remote_code=args.trust_remote_code)
    print(f"exported to {out} (see {out}/README.md for the SGLang and vLLM command lines)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a drafter in the layout SGLang and vLLM serve")
    p.add_argument("--drafter", required=True, help="eyas run dir, train run dir, drafter dir, or exported/published EAGLE-3 or DFlash dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weight dtype (default bf16)")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="export although the drafter's recorded target differs from --target (a warning is written "
                        "into the export's README; converts an old-style fingerprint)")
    p.add_argument("--target", default=None,
                   help="target spec to check against the training fingerprint (and to name in the README)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow --target's own code (its tokenizer or config); a target that needs it is refused "
                        "without")
    p.set_defaults(func=_run)
