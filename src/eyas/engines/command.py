"""`eyas engine launch-args | patch | crosscheck | check | ingest-vllm`."""

from __future__ import annotations

import json
from pathlib import Path

import eyas.target  # load_target looked up at call time: tests patch it
from eyas.engines import launch_args as la, sglang_patch as sp
from eyas.engines.crosscheck import crosscheck, reference_states, report
from eyas.engines.served_check import CheckConfig, report as check_report, run_served_check
from eyas.engines.vllm_ingest import run_ingest, skip_summary
from eyas.errors import EyasError
from eyas.knobs import add_command
from eyas.store.reader import Store


def _launch(a) -> int:
    """Print the SGLang or vLLM server command that serves the target with eyas's capture switched on: one flag and
    its value per line, ready to paste into a shell. `eyas capture --engine` then sends the prepared data to it."""
    ids = [int(x) for x in a.aux_layer_ids.split(",")] if a.aux_layer_ids else None
    if Path(a.target_config).is_dir():   # a target directory (weightless will do): its config.json
        a.target_config = str(Path(a.target_config) / "config.json")
    if a.engine == "sglang":
        args = la.sglang_args(a.target_config, a.engine_version, model=a.model, store=a.store, data=a.data,
                              aux_layer_ids=ids, tp=a.tp, attn_dp=a.attn_dp, ep=a.ep,
                              lm_head=a.lm_head_module or None)
    else:
        n = a.max_model_len or ((la.longest_prompt(a.data) or 0) + 1)   # + the one token each request generates
        if a.attn_dp != 1:
            la.check_parallel("vllm", a.tp, a.attn_dp, a.ep)
        args = la.vllm_args(a.target_config, model=a.model, out_dir=a.vllm_dir, aux_layer_ids=ids, tp=a.tp, ep=a.ep,
                            max_model_len=n if n > 1 else None)
    print(la.format_command(args))
    return 0


def _patch(a) -> int:
    """Patch (or check, or revert) the installed SGLang's model files so that they call eyas's capture hook: for
    SGLang versions without forward hooks."""
    d = sp.models_dir(a.sglang_dir)
    if a.check:
        for c in sp.plan(d):
            print(c.diff() or f"{c.path}: already patched")
    elif a.apply:
        print("\n".join(f"patched {p}" for p in sp.apply(d)) or "already patched")
    else:
        print("\n".join(f"restored {p}" for p in sp.revert(d)) or "nothing to revert")
    return 0


def _crosscheck(a) -> int:
    """Compare the first samples of an engine-captured store with the same samples captured in process (the whole
    target loads here), layer by layer."""
    st = Store(a.store, allow_incomplete=True)
    if len(st) == 0:
        raise EyasError(f"{a.store}: the store holds no samples, so there is nothing to crosscheck (did the "
                        f"engine capture write any? see its events and skipped files)")
    t = eyas.target.load_target(a.target, aux_layer_ids=tuple(st.aux_layer_ids),   # runs the forward: the whole target
                    trust_remote_code=a.trust_remote_code)
    n = min(a.n, len(st))
    samples = [st.get(i, dtype=__import__("torch").float32) for i in range(n)]
    eng = [__import__("torch").cat([s.aux, s.final[:, None]], dim=1) for s in samples]
    ref = reference_states(t.model, [s.input_ids for s in samples])
    rows = crosscheck(eng, ref, st.aux_layer_ids, tol=a.tol)
    print(report(rows))
    return 0 if all(r["ok"] for r in rows) else 1


def _check(a) -> int:
    """Check an engine-captured store against the server that wrote it, reading only the target's embedding, LM head
    and final norm: greedy tokens, the post-norm final slot and (SGLang) the aux layers probed."""
    res = run_served_check(CheckConfig(engine=a.engine, url=a.url, store=a.store, target=a.target, n=a.n, tol=a.tol,
                                       vllm_dir=a.vllm_dir))
    print(check_report(res["rows"]))
    return 0 if res["ok"] else 1


def _ingest(a) -> int:
    """Turn the hidden-state files a vLLM server dumped (its extract_hidden_states connector) into an eyas store,
    applying the target's final norm."""
    import sys  # noqa: PLC0415
    summary = run_ingest(a.vllm_dir, a.data, a.out, a.target_config, a.target_weights or None)
    print(json.dumps(summary, indent=1))
    line = skip_summary(summary)
    if line:
        print(line, file=sys.stderr)
    # skipped files are not fatal: only a run that ingested nothing and left the store incomplete fails
    return 0 if summary["written"] or summary["complete"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "engine", help="capture through SGLang / vLLM servers",
        description="Capture hidden states through a serving engine, for targets too large to load in process: the "
                    "server command to launch (launch-args), the SGLang source patch, and checks of what the engine "
                    "captured (crosscheck, check); vLLM's dumps become a store with ingest-vllm. docs/engines.md "
                    "walks through it.")
    sub = p.add_subparsers(dest="engine_cmd", required=True)
    la = add_command(sub, "launch-args", _launch, help="print the server command for capture")
    la.add_argument("engine", choices=["sglang", "vllm"])
    target = la.add_argument_group("target")
    target.add_argument("--target-config", required=True, help="the target's HF config.json or its directory")
    target.add_argument("--aux-layer-ids", default="", help="HF ids a,b,c (default 2,N//2,N-3)")
    target.add_argument("--lm-head-module", default="",
                        help="SGLang module name of the target's LogitsProcessor (default: known per architecture)")
    target.add_argument("--version", dest="engine_version", default="0.5.23", help="SGLang version")
    parallel = la.add_argument_group("parallelism")
    parallel.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parallel.add_argument("--attn-dp", type=int, default=1, help="SGLang attention-DP groups (dividing --tp)")
    parallel.add_argument("--ep", type=int, default=1,
                          help="expert parallel size (SGLang: dividing --tp; vLLM: --tp)")
    paths = la.add_argument_group("paths and sizes written into the command")
    paths.add_argument("--model", default="MODEL", help="the served model's directory (default: %(default)s)")
    paths.add_argument("--store", default="STORE", help="SGLang: the store the hook writes (default: %(default)s)")
    paths.add_argument("--data", default="PREPARED", help="the prepared data to be captured (default: %(default)s)")
    paths.add_argument("--vllm-dir", default="VLLM_OUT",
                       help="vLLM: the directory its hidden-state dumps go to (default: %(default)s)")
    paths.add_argument("--max-model-len", type=int, default=0,
                       help="vLLM's context (default: the longest sample of --data plus one; never the target's own)")
    pa = add_command(sub, "patch", _patch, help="AST-patch SGLang model files to call the eyas hook")
    pa.add_argument("engine", choices=["sglang"])
    g = pa.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true", help="print the changes a patch would make")
    g.add_argument("--apply", action="store_true", help="patch the files")
    g.add_argument("--revert", action="store_true", help="restore the files as they were")
    pa.add_argument("--sglang-dir", default=None, help="sglang package dir (default: the installed one)")
    cc = add_command(sub, "crosscheck", _crosscheck, help="engine-path store vs in-process capture, per layer")
    cc.add_argument("--store", required=True, help="the engine-captured store")
    cc.add_argument("--target", required=True, help="the target model (loaded with its weights)")
    cc.add_argument("-n", type=int, default=8, help="samples compared (default: %(default)s)")
    cc.add_argument("--tol", type=float, default=0.02,
                    help="largest relative error ||engine - reference|| / ||reference|| counted as equal (bf16 engine)")
    cc.add_argument("--trust-remote-code", action="store_true",
                    help="allow the target's own code (its model, tokenizer or config)")
    ck = add_command(sub, "check", _check,
                     help="engine-captured store vs the served target, with its head tensors only")
    ck.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    ck.add_argument("--url", required=True, help="the server that captured the store")
    ck.add_argument("--store", required=True, help="the store (SGLang: the hook's --store; its probes land in it)")
    ck.add_argument("--target", required=True, help="target directory: config.json and the safetensors holding the "
                    "embedding, LM head and final norm (a weightless copy will do)")
    ck.add_argument("-n", type=int, default=4, help="stored samples re-sent")
    ck.add_argument("--tol", type=float, default=0.02,
                    help="largest relative error of an aux slot against its probed layer (bf16 engine)")
    ck.add_argument("--vllm-dir", default="", help="vLLM: the directory of its hidden-state dumps (the check's own "
                    "dumps are removed)")
    iv = add_command(sub, "ingest-vllm", _ingest, help="vLLM extract_hidden_states files -> store")
    iv.add_argument("--vllm-dir", required=True, help="the directory of vLLM's dumps")
    iv.add_argument("--data", required=True, help="the prepared data the server was sent")
    iv.add_argument("--out", required=True, help="the store, created by `eyas capture --engine vllm`")
    iv.add_argument("--target-config", required=True,
                    help="the served target's config.json (vLLM's last slot is pre-norm; eyas applies its final norm)")
    iv.add_argument("--target-weights", default="", help="dir of its safetensors (default: beside --target-config)")
