"""`eyas engine launch-args | patch | crosscheck | check | ingest-vllm`."""

from __future__ import annotations

import json
from pathlib import Path

from eyas.errors import EyasError


def _launch(a) -> int:
    from eyas.engines import launch_args as la
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
    from eyas.engines import sglang_patch as sp
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
    from eyas.engines.crosscheck import crosscheck, reference_states, report
    from eyas.store.reader import Store
    from eyas.target import load_target
    st = Store(a.store, allow_incomplete=True)
    if len(st) == 0:
        raise EyasError(f"{a.store}: the store holds no samples, so there is nothing to crosscheck (did the "
                        f"engine capture write any? see its events and skipped files)")
    t = load_target(a.target, aux_layer_ids=tuple(st.aux_layer_ids),   # runs the forward: the whole target
                    trust_remote_code=a.trust_remote_code)
    n = min(a.n, len(st))
    samples = [st.get(i, dtype=__import__("torch").float32) for i in range(n)]
    eng = [__import__("torch").cat([s.aux, s.final[:, None]], dim=1) for s in samples]
    ref = reference_states(t.model, [s.input_ids for s in samples])
    rows = crosscheck(eng, ref, st.aux_layer_ids, tol=a.tol)
    print(report(rows))
    return 0 if all(r["ok"] for r in rows) else 1


def _check(a) -> int:
    from eyas.engines.served_check import CheckConfig, report, run_served_check
    res = run_served_check(CheckConfig(engine=a.engine, url=a.url, store=a.store, target=a.target, n=a.n, tol=a.tol,
                                       vllm_dir=a.vllm_dir))
    print(report(res["rows"]))
    return 0 if res["ok"] else 1


def _ingest(a) -> int:
    import sys  # noqa: PLC0415
    from eyas.engines.vllm_ingest import run_ingest, skip_summary
    summary = run_ingest(a.vllm_dir, a.data, a.out, a.target_config, a.target_weights or None)
    print(json.dumps(summary, indent=1))
    line = skip_summary(summary)
    if line:
        print(line, file=sys.stderr)
    # skipped files are not fatal: only a run that ingested nothing and left the store incomplete fails
    return 0 if summary["written"] or summary["complete"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("engine", help="capture through SGLang / vLLM servers")
    sub = p.add_subparsers(dest="engine_cmd", required=True)
    la = sub.add_parser("launch-args", help="print the server command for capture")
    la.add_argument("engine", choices=["sglang", "vllm"])
    la.add_argument("--target-config", required=True, help="the target's HF config.json or its directory")
    la.add_argument("--version", dest="engine_version", default="0.5.23", help="SGLang version")
    la.add_argument("--model", default="MODEL")
    la.add_argument("--store", default="STORE")
    la.add_argument("--data", default="PREPARED")
    la.add_argument("--vllm-dir", default="VLLM_OUT")
    la.add_argument("--aux-layer-ids", default="", help="HF ids a,b,c (default 2,N//2,N-3)")
    la.add_argument("--tp", type=int, default=1)
    la.add_argument("--attn-dp", type=int, default=1, help="SGLang attention-DP groups (dividing --tp)")
    la.add_argument("--ep", type=int, default=1, help="expert parallel size (SGLang: dividing --tp; vLLM: --tp)")
    la.add_argument("--max-model-len", type=int, default=0,
                    help="vLLM's context (default: the longest sample of --data plus one; never the target's own)")
    la.add_argument("--lm-head-module", default="",
                    help="SGLang module name of the target's LogitsProcessor (default: known per architecture)")
    la.set_defaults(func=_launch)
    pa = sub.add_parser("patch", help="AST-patch SGLang model files to call the eyas hook")
    pa.add_argument("engine", choices=["sglang"])
    g = pa.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true")
    g.add_argument("--apply", action="store_true")
    g.add_argument("--revert", action="store_true")
    pa.add_argument("--sglang-dir", default=None, help="sglang package dir (default: the installed one)")
    pa.set_defaults(func=_patch)
    cc = sub.add_parser("crosscheck", help="engine-path store vs in-process capture, per layer")
    cc.add_argument("--store", required=True)
    cc.add_argument("--target", required=True)
    cc.add_argument("-n", type=int, default=8)
    cc.add_argument("--tol", type=float, default=0.02,
                    help="largest relative error ||engine - reference|| / ||reference|| counted as equal (bf16 engine)")
    cc.add_argument("--trust-remote-code", action="store_true",
                    help="allow the target's own code (its model, tokenizer or config)")
    cc.set_defaults(func=_crosscheck)
    ck = sub.add_parser("check", help="engine-captured store vs the served target, with its head tensors only")
    ck.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    ck.add_argument("--url", required=True, help="the server that captured the store")
    ck.add_argument("--store", required=True, help="the store (SGLang: the hook's --store; its probes land in it)")
    ck.add_argument("--target", required=True, help="target directory: config.json and the safetensors holding the "
                    "embedding, LM head and final norm (a weightless copy will do)")
    ck.add_argument("-n", type=int, default=4, help="stored samples re-sent")
    ck.add_argument("--tol", type=float, default=0.02,
                    help="largest relative error of an aux slot against its probed layer (bf16 engine)")
    ck.add_argument("--vllm-dir", default="", help="vLLM: shared_storage_path (the check's own dumps are removed)")
    ck.set_defaults(func=_check)
    iv = sub.add_parser("ingest-vllm", help="vLLM extract_hidden_states files -> store")
    iv.add_argument("--vllm-dir", required=True)
    iv.add_argument("--data", required=True)
    iv.add_argument("--out", required=True, help="store created by run_engine_capture / capture --engine")
    iv.add_argument("--target-config", required=True,
                    help="the served target's config.json (vLLM's last slot is pre-norm; eyas applies its final norm)")
    iv.add_argument("--target-weights", default="", help="dir of its safetensors (default: beside --target-config)")
    iv.set_defaults(func=_ingest)
