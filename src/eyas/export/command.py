"""`eyas export`: argument parsing only; the work is eyas.export.export.run_export."""

from __future__ import annotations

import argparse

from eyas.bench.command import recorded_fingerprint
from eyas.export.export import run_export
from eyas.knobs import FROM_DRAFTER, FROM_FLAG, add_command, announce_target


def _run(args: argparse.Namespace) -> int:
    """Write a drafter (EAGLE-3 or DFlash) as the serving engines load it: config.json and model.safetensors in the
    engines' names, and a README.md with the SGLang and vLLM commands that serve it beside its target."""
    if args.target:
        announce_target("export", args.target, FROM_FLAG)
    else:   # the export names the recorded target in its README; nothing is checked against it
        _, fingerprint = recorded_fingerprint(args.drafter)
        name = (fingerprint or {}).get("identity")
        announce_target("export", name or "TARGET", FROM_DRAFTER if name else
                        "the drafter records none; --target names it in the README")
    out = run_export(args.drafter, args.out, dtype=args.dtype, target_spec=args.target,
                     allow_target_mismatch=args.allow_target_mismatch, trust_remote_code=args.trust_remote_code)
    print(f"exported to {out} (see {out}/README.md for the SGLang and vLLM command lines)")
    return 0


def register(subparsers) -> None:
    p = add_command(subparsers, "export", _run, help="write a drafter in the layout SGLang and vLLM serve")
    drafter = p.add_argument_group("drafter")
    drafter.add_argument("--drafter", required=True, help="eyas run dir, train run dir, drafter dir, or "
                         "exported/published EAGLE-3 or DFlash dir")
    target = p.add_argument_group("target")
    target.add_argument("--target", default=None,
                        help="target to check against the drafter's recorded one and to name in the README (default: "
                             "the drafter's recorded name, not checked)")
    target.add_argument("--allow-target-mismatch", action="store_true",
                        help="export although the drafter's recorded target differs from --target (a warning is "
                             "written into the export's README; converts an old-style fingerprint)")
    target.add_argument("--trust-remote-code", action="store_true",
                        help="allow --target's own code (its tokenizer or config); a target that needs it is refused "
                             "without")
    output = p.add_argument_group("output")
    output.add_argument("--out", required=True, help="output directory")
    output.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                        help="weight dtype (default bf16)")
