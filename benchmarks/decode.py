"""Decoding benchmark (GPU): plain fast decoding vs model.generate, speculative chains and tree.

    python -m benchmarks.decode --target smollm2-135m [--drafter RUN] [--compile]

Batched speculative decoding (`eyas.decode.batch`: greedy eagle chains, every row accepting its own length)
against batched plain decoding (`Runner.generate`), at each batch size; this runs only that comparison:

    python -m benchmarks.decode --batch 1,4,16,64 --chain 3 [--drafter RUN | --random-drafter]
    python -m benchmarks.decode --batch 1,4,16 --tiny --dtype fp32 --max-new-tokens 64  # CPU smoke

Greedy chains (and with --tree the default tree) at batch 1 with each round ONE CUDA graph (`eyas.decode.round`'s
RoundDecoder) against host-driven rounds (`SpecDecoder`, the static drafter cache and graphed verify) and plain
decoding, on the same prompts and runner; with --compile both also with the drafter's steps compiled
(`compile_drafter`):

    python -m benchmarks.decode --round graph --chain 3,5 [--drafter RUN | --random-drafter] [--compile]
    python -m benchmarks.decode --round graph --tiny --dtype fp32 --max-new-tokens 64  # CPU smoke

Prints a table and appends it as a dated section to BENCHMARKS.md (benchmarks.record: --md FILE, --no-record).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time

import torch

from benchmarks import record


def tok_per_s(fn, tokens_fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens_fn(out) / (time.perf_counter() - t0)


def tiny_target(seed: int = 0):
    """A tiny random Llama (4 layers, width 64, vocab 256; eos id 2) wrapped as an eyas Target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target.load import target_from_model

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return target_from_model(LlamaForCausalLM(cfg).eval(), name="tiny-random")


def batch_compare(args) -> int:
    """--batch: tok/s of batched eagle chains and of batched plain decoding on the same prompts and runner."""
    from eyas.decode.batch import BatchChainDecoder, BatchSpecConfig
    from eyas.target.runner import Runner

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    N, K, M = args.max_new_tokens, args.chain, args.max_seq
    keep = M - N - K - 2  # prompt tokens that fit the cache with the new and draft tokens
    if args.tiny:
        target = tiny_target()
        target.model.to(device=dev, dtype=dtype)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist()
                   for n in torch.randint(4, 128, (64,), generator=g)]
        drafter_name = "UNTRAINED random (timing only, tau ~1)"
    else:
        from eyas.data.chat import encode_prompt
        from eyas.data.prompts import load_prompts
        from eyas.target import load_target

        target = load_target(args.target, device=dev, dtype=dtype)
        recs = load_prompts(args.prompts.split(",")[0], limit=max(64, args.limit))
        prompts = [encode_prompt(target.tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in recs]
        drafter_name = args.drafter or "UNTRAINED random (timing only, tau ~1)"
    prompts = [p[-keep:] for p in prompts]
    if args.drafter:
        from eyas.model.checkpoint import open_drafter
        drafter, _ = open_drafter(args.drafter, target=target)
    elif args.random_drafter or args.tiny:
        from eyas.model.drafter import DrafterConfig, Eagle3Drafter
        torch.manual_seed(0)
        drafter = Eagle3Drafter(DrafterConfig.from_target(target.config, draft_vocab_size=32000,
                                                          aux_layer_ids=target.aux_layer_ids))
    else:
        print("--batch needs a drafter: --drafter RUN, --random-drafter or --tiny", file=sys.stderr)
        return 2
    eos = target.eos_token_ids
    rows: list[tuple[str, str]] = []
    results: dict = {}
    for B in [int(b) for b in args.batch.split(",")]:
        batch = (prompts * ((B + len(prompts) - 1) // len(prompts)))[:B]
        # dynamic with --compile: batched plain decoding meets a (rows, window) shape per compaction and window,
        # more than dynamo's recompile limit; one dynamic compile serves them all (as prepare's regeneration)
        r = Runner.from_hf(target.model, max_batch=B, max_seq=M, compile=args.compile, dynamic=args.compile)
        dec = BatchChainDecoder(r, drafter, BatchSpecConfig(k=K))
        # warm-up: on CUDA every shape the timed runs reach (compaction shrinks the batch), else a few tokens
        warm = N if dev.type == "cuda" else min(N, 4)
        r.generate(batch, warm, eos_ids=eos)
        dec.generate(batch, warm, eos_ids=eos)
        plain_out, t_plain = timed(lambda: r.generate(batch, N, eos_ids=eos), dev)
        (outs, stats), t_spec = timed(lambda: dec.generate(batch, N, eos_ids=eos), dev)
        plain, spec = sum(map(len, plain_out)) / t_plain, sum(map(len, outs)) / t_spec
        tau = sum(s.tokens for s in stats) / max(sum(s.target_forwards for s in stats), 1)
        same = sum(a == b for a, b in zip(outs, plain_out))
        results[f"b{B}"] = dict(plain_tok_s=plain, chain_tok_s=spec, ratio=spec / plain, tau=tau,
                                identical_rows=same, rows=B, tokens=sum(map(len, outs)))
        rows.append((f"batch {B}: plain", f"{plain:.0f} tok/s"))
        rows.append((f"batch {B}: eagle chain-{K}", f"{spec:.0f} tok/s, tau {tau:.2f}, {spec / plain:.2f}x plain, "
                                                    f"rows identical to plain {same}/{B}"))
        print(rows[-2], rows[-1], flush=True)
        del r, dec
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    print(record.write(args, "batched decode benchmark", _table(rows), command=record.command_line(__spec__.name),
                       machine=record.device_name(dev),
                       details=[f"dtype {args.dtype}; threads {torch.get_num_threads()}",
                                f"target: {'tiny random Llama' if args.tiny else args.target}; "
                                f"drafter: {drafter_name}; max new tokens {N}; cache {M}; eos {eos}"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def round_compare(args) -> int:
    """--round graph: batch-1 tok/s, tau and ms per round of one-graph rounds vs host rounds vs plain decoding."""
    from eyas.decode.spec import SpecConfig, SpecDecoder
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from eyas.target.runner import Runner

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.compile and dev.type != "cuda":
        print("--round graph --compile needs CUDA: on the CPU each step attends its own number of slots, a new "
              "compiled shape per token", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    N, M, Ks = args.max_new_tokens, args.max_seq, [int(k) for k in str(args.chain).split(",")]
    if args.tiny:
        target = tiny_target()
        target.model.to(device=dev, dtype=dtype)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(4, 128, (8,), generator=g)]
    else:
        from eyas.data.chat import encode_prompt
        from eyas.data.prompts import load_prompts
        from eyas.target import load_target

        target = load_target(args.target, device=dev, dtype=dtype)
        recs = load_prompts(args.prompts.split(",")[0], limit=args.limit)
        prompts = [encode_prompt(target.tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in recs]
    draft = max(Ks + ([SpecConfig(method="tree").draft_size] if args.tree else []))
    prompts = [p[-(M - N - draft - 2):] for p in prompts]
    if args.drafter:
        from eyas.model.checkpoint import open_drafter
        drafter, _ = open_drafter(args.drafter, target=target)
    else:
        torch.manual_seed(0)
        drafter = Eagle3Drafter(DrafterConfig.from_target(target.config, draft_vocab_size=32000,
                                                          aux_layer_ids=target.aux_layer_ids))
    eos, r = target.eos_token_ids, Runner.from_hf(target.model, max_batch=1, max_seq=M, compile=args.compile,
                                                  gemv=args.gemv)
    # window=0: every plain step attends over all max_seq slots, one graph shape warmed here, as in `eyas bench`
    # (with windows, each prompt length compiled a new shape inside the clock: 14 tok/s on 2026-12-01)
    r.generate(prompts[:1], 4, window=0)
    plain, t_plain = timed(lambda: [r.generate([p], N, eos_ids=eos, window=0)[0] for p in prompts], dev)
    # the prefills alone (one new token per prompt): how much of the per-token figures below is prompt processing
    _, t_pre = timed(lambda: [r.generate([p], 1, window=0) for p in prompts], dev)
    steps = max(sum(map(len, plain)) - len(prompts), 1)
    rows = [("plain, batch 1", f"{sum(map(len, plain)) / t_plain:.0f} tok/s, "
                               f"{1e3 * t_plain / sum(map(len, plain)):.3f} ms/step (prefill included), "
                               f"{1e3 * (t_plain - t_pre) / steps:.3f} ms/step after the prefill"),
            ("plain prefills (first token only)", f"{1e3 * t_pre / len(prompts):.1f} ms per prompt, "
                                                   f"{sum(map(len, prompts)) / len(prompts):.0f} tokens per prompt")]
    variants = [("host rounds", False, False), ("one-graph rounds", True, False)]
    if args.compile:  # the drafter's steps compiled too (SpecDecoder compile_drafter)
        variants += [("host rounds, compiled drafter", False, True), ("one-graph rounds, compiled drafter", True, True)]
    runs = [(f"eagle chain-{K}, {name}", SpecConfig(method="chain", k=K, graph_round=graph), cd)
            for K in Ks for name, graph, cd in variants]
    if args.tree:  # the default EAGLE-2 tree (static proposer): host rounds and one-graph rounds, with --compile
        # also with the proposer compiled
        runs += [(f"eagle tree, {'one-graph' if graph else 'host'} rounds, {'compiled' if cd else 'eager'} proposer",
                  SpecConfig(method="tree", graph_round=graph), cd)
                 for cd in ([False, True] if args.compile else [False]) for graph in (False, True)]
    for label, spec, cd in runs:
        try:  # one failing variant (e.g. a compile error) is a row of the table, not the end of the benchmark
            dec = SpecDecoder(r, drafter, spec, compile_drafter=cd)
            dec.generate(prompts[0], N, eos_ids=eos)  # warm-up: captures and compiles
            res, t = timed(lambda: [dec.generate(p, N, eos_ids=eos) for p in prompts], dev)
        except Exception as e:  # noqa: BLE001
            rows.append((label, f"FAILED: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"))
            print(rows[-1], flush=True)
            continue
        toks, fw, rounds = (sum(getattr(s, f) for _, s in res) for f in ("tokens", "target_forwards", "rounds"))
        same = sum(o == q for (o, _), q in zip(res, plain))
        # issue 14's goals: a round in plain steps (both with their prefills), and speed against tau x plain
        plain_rate, step_ms = sum(map(len, plain)) / t_plain, 1e3 * t_plain / sum(map(len, plain))
        round_ms, tau = 1e3 * t / max(rounds, 1), toks / fw
        rows.append((label, f"{toks / t:.0f} tok/s, tau {tau:.2f}, {round_ms:.2f} ms/round (prefill included) = "
                     f"{round_ms / step_ms:.2f} plain steps, {toks / t / plain_rate:.2f}x plain = "
                     f"{toks / t / (tau * plain_rate):.2f} x tau x plain, identical {same}/{len(prompts)}"))
        print(rows[-1], flush=True)
    title = "one-graph chain rounds" + (" and the tree" if args.tree else "")
    print(record.write(args, title, _table(rows), command=record.command_line(__spec__.name),
                       machine=record.device_name(dev),
                       details=[f"dtype {args.dtype}; threads {torch.get_num_threads()}",
                                f"target: {'tiny random Llama' if args.tiny else args.target}; drafter: "
                                f"{args.drafter or 'UNTRAINED random (timing only, tau ~1)'}; {len(prompts)} prompts; "
                                f"max new tokens {N}; cache {M}"]))
    return 0


def _table(rows: list[tuple[str, str]]) -> str:
    return "| what | result |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def timed(fn, device):
    """(fn(), wall seconds), the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", default="sharegpt-heldout,humaneval")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the graphed target steps")
    ap.add_argument("--batches", default="1,16,64,256", help="batch sizes for plain decoding throughput")
    ap.add_argument("--compile-batches", default="1", help="batch sizes also timed with --compile")
    ap.add_argument("--spec-compile", action="store_true", help="also compile the speculative verify steps")
    ap.add_argument("--hf-prompts", type=int, default=2, help="prompts timed with model.generate")
    ap.add_argument("--random-drafter", action="store_true",
                    help="time the speculative loop with an untrained drafter (tau ~1; cost per round only)")
    ap.add_argument("--max-seqs", default="1024", help="cache lengths timed for plain batch-1 decoding")
    ap.add_argument("--batch", default=None,
                    help="batched eagle chains vs batched plain decoding at these batch sizes (e.g. 1,4,16,64); "
                         "runs only this comparison (needs --drafter, --random-drafter or --tiny)")
    ap.add_argument("--chain", default="3", help="--batch: draft tokens per round; --round: comma-separated list")
    ap.add_argument("--round", default=None, choices=["graph"],
                    help="batch-1 greedy chains with each round one CUDA graph vs host rounds vs plain; runs only this")
    ap.add_argument("--tree", action="store_true", help="--round: also time the default tree (static proposer)")
    ap.add_argument("--gemv", type=int, default=None,
                    help="--round with --compile: the runner's gemv rows (default: the runner's, 1 on CUDA; 0: "
                         "cuBLAS GEMMs for the plain step too, e.g. to see whether gemv moves bf16 agreement)")
    ap.add_argument("--tiny", action="store_true",
                    help="--batch/--round: a tiny random Llama target and random drafter, random prompts (CPU smoke test)")
    record.add_options(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.round:
        return round_compare(args)
    if args.batch:
        args.chain = int(args.chain)
        return batch_compare(args)

    from eyas.bench.bench import BenchConfig, run_bench
    from eyas.data.chat import encode_prompt
    from eyas.data.prompts import load_prompts
    from eyas.target import load_target
    from eyas.target.runner import Runner

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    t0 = time.time()
    target = load_target(args.target, device=dev, dtype=dtype)
    print(f"target loaded in {time.time() - t0:.1f}s", flush=True)
    tok, eos = target.tokenizer, target.eos_token_ids
    recs = load_prompts(args.prompts.split(",")[0], limit=64)
    prompts = [encode_prompt(tok, [{"role": "user", "content": r["turns"][0]}])[-512:] for r in recs]
    N = args.max_new_tokens
    rows: list[tuple[str, str]] = []
    results: dict = {}

    # model.generate at batch 1 (HF dynamic cache, the slow reference)
    model = target.model
    gen_tokens = 0
    t = time.perf_counter()
    for p in prompts[:args.hf_prompts]:
        with torch.no_grad():
            o = model.generate(torch.tensor([p], device=dev), max_new_tokens=N, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        gen_tokens += o.shape[1] - len(p)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    results["hf_generate_b1"] = gen_tokens / (time.perf_counter() - t)
    rows.append(("model.generate, batch 1", f"{results['hf_generate_b1']:.0f} tok/s"))

    # eyas plain decoding: CUDA graphs, with and without torch.compile
    for comp in ([False, True] if args.compile else [False]):
        for B in [int(b) for b in (args.compile_batches if comp else args.batches).split(",")]:
            t = time.perf_counter()
            r = Runner.from_hf(model, max_batch=B, max_seq=int(args.max_seqs.split(",")[0]), compile=comp)
            batch = (prompts * ((B + len(prompts) - 1) // len(prompts)))[:B]
            r.generate(batch, 4)  # capture / compile
            build = time.perf_counter() - t
            rate = tok_per_s(lambda: r.generate(batch, N), lambda out: sum(map(len, out)), dev)
            key = f"plain_b{B}{'_compiled' if comp else ''}"
            results[key] = rate
            rows.append((f"eyas plain, batch {B}{', compiled' if comp else ''}", f"{rate:.0f} tok/s (setup {build:.0f}s)"))
            print(rows[-1], flush=True)
            del r
            torch.cuda.empty_cache() if dev.type == "cuda" else None

    for M in [int(m) for m in args.max_seqs.split(",")[1:]]:
        r = Runner.from_hf(model, max_batch=1, max_seq=M)
        r.generate(prompts[:1], 4)
        rate = tok_per_s(lambda: r.generate(prompts[:1], N), lambda out: sum(map(len, out)), dev)
        rows.append((f"eyas plain, batch 1, cache {M}", f"{rate:.0f} tok/s"))
        print(rows[-1], flush=True)

    # speculative decoding in the same process (plain baseline measured by run_bench itself)
    drafter = meta = None
    if args.drafter:
        from eyas.model.checkpoint import open_drafter
        drafter, meta = open_drafter(args.drafter, target=target)
    elif args.random_drafter:
        from eyas.model.drafter import DrafterConfig, Eagle3Drafter
        torch.manual_seed(0)
        drafter = Eagle3Drafter(DrafterConfig.from_target(target.config, draft_vocab_size=32000,
                                                          aux_layer_ids=target.aux_layer_ids))
    shapes = [("chain", 3), ("chain", 5), ("tree", 0)] if drafter is not None else [("chain", 5)]
    for pset in args.prompts.split(","):
        for method, k in shapes:
            cfg = BenchConfig(target=args.target, drafter=None, prompts=pset, method=method, k=k or 5,
                              max_new_tokens=N, limit=args.limit, max_seq=args.max_seq, device=str(dev),
                              compile=args.spec_compile, baselines=True)
            buf = io.StringIO()
            rep = run_bench(cfg, target=target, drafter=drafter, drafter_meta=meta, out=buf)
            print(buf.getvalue(), flush=True)
            results[f"{pset}_{method}{k or ''}"] = rep["methods"]
            for name, m in rep["methods"].items():
                if name == "plain" and (method, k) != shapes[0]:
                    continue
                label = f"{pset} {name}{k if name == 'eagle-chain' else ''}"
                rows.append((label, f"{m['tokens_per_s']:.0f} tok/s, tau {m['tau']:.2f}, "
                                    f"speedup {m.get('speedup', 1.0):.2f}"))
            if "lossless" in rep:
                rows.append((f"{pset} lossless ({method}{k or ''})",
                             ", ".join(f"{n}: {v['identical_turns']}/{v['turns']}" for n, v in rep["lossless"].items())))

    drafter_name = args.drafter or ("UNTRAINED random (timing only, tau ~1)" if args.random_drafter
                                    else "none (baselines only)")
    print(record.write(args, "decode benchmark", _table(rows), command=record.command_line(__spec__.name),
                       machine=record.device_name(dev),
                       details=[f"dtype {args.dtype}", f"target: {args.target}; drafter: {drafter_name}; max new "
                                f"tokens {N}; prompts {args.prompts} (limit {args.limit})"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
