"""Output tok/s and the engine's own accept length of a running SGLang or vLLM server (issue 13).

    python -m benchmarks.gpu.engine_measure --engine sglang --url http://127.0.0.1:30000 \
        --target HF_DIR --prompts sharegpt-heldout --limit 16 --batch 1 --config chain

Sends the first user turn of each prompt record as token ids, built exactly as `eyas bench` builds them
(`load_bench_prompts` with --max-prompt-tokens, then `encode_prompt`), greedy, --max-new-tokens each, --batch requests in flight. Prints one JSON line.
Two accept lengths:
- `accept_length`, the engine's convention: tokens per verify step, the bonus token counted;
  - SGLang: (completion tokens - 1 per reply) / `spec_verify_ct` (SGLang adds that field only when speculation
    ran; the first token comes from the prefill); SGLang's own `spec_accept_length` is kept beside it;
  - vLLM: 1 + accepted / drafts, from the server's Prometheus counters before and after;
- `tau`, eyas bench's unit: completion tokens / (verify steps + 1 prefill per reply), so plain decoding is 1.
A configuration without a drafter (`--config plain`) has no accept length; it is the speedup's baseline.
`--dry-run` loads the prompts and prints their token counts without a server. `--prefill PREPARED` times the
capture client's one-token requests of those conversations instead (the engine's plain prefill tok/s).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from eyas.engines.client import request_body
from eyas.serving import post_json

VLLM_COUNTERS = ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total")


def counter(url: str, name: str) -> float:
    import httpx
    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def prefill(args) -> int:
    """Each prepared conversation once, one new token (the capture client's request, `request_body`), 16 in
    flight: the engine's prefill tok/s on the conversations a capture sends."""
    from eyas.data.prepared import PreparedData
    samples = [list(s.input_ids) for s in PreparedData(args.prefill)]

    def one(k: int) -> dict:
        path, body = request_body(args.engine, f"prefill-{k}", samples[k])
        return post_json(args.url + path, body, 600)

    t = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(len(samples))))
    dt = time.perf_counter() - t
    n = sum(map(len, samples))
    print(json.dumps({"engine": args.engine, "samples": len(samples), "tokens": n, "seconds": round(dt, 2),
                      "prefill_tok_s": round(n / dt)}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("sglang", "vllm"), required=True)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--target", required=True, help="the HF directory the server serves (its tokenizer)")
    ap.add_argument("--served-name", default="eyas", help="vLLM's --served-model-name")
    ap.add_argument("--prompts", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=1536,
                    help="skip longer records, as `eyas bench --max-prompt-tokens` does (the same records)")
    ap.add_argument("--config", default="plain", help="a name; `plain` = served without a drafter")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--prefill", metavar="PREPARED", help="instead: time one-token requests of these prepared "
                    "conversations (the server serves vLLM as launch_args.VLLM_SERVED_NAME)")
    args = ap.parse_args()
    if args.prefill:
        return prefill(args)

    from transformers import AutoTokenizer

    from eyas.bench.bench import BenchConfig, load_bench_prompts
    from eyas.data.chat import encode_prompt

    tok = AutoTokenizer.from_pretrained(args.target)
    records, skipped = load_bench_prompts(BenchConfig(prompts=args.prompts, limit=args.limit, max_turns=1,
                                                      max_prompt_tokens=args.max_prompt_tokens), tok)
    prompts = [encode_prompt(tok, [{"role": "user", "content": r["turns"][0]}]) for r in records]
    if args.dry_run:
        print(json.dumps({"prompts": args.prompts, "records": len(prompts), "skipped": skipped, "prompt_tokens": [len(p) for p in prompts]}))
        return 0

    def one(ids: list[int]) -> tuple[int, int | None, float | None]:
        if args.engine == "sglang":
            r = post_json(args.url + "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.max_new_tokens, "temperature": 0}}, 600)
            m = r["meta_info"]
            return m["completion_tokens"], m.get("spec_verify_ct"), m.get("spec_accept_length")
        r = post_json(args.url + "/v1/completions", {"model": args.served_name, "prompt": ids,
                                                     "max_tokens": args.max_new_tokens, "temperature": 0}, 600)
        return r["usage"]["completion_tokens"], None, None

    spec = args.config != "plain"
    before = [counter(args.url, n) for n in VLLM_COUNTERS] if args.engine == "vllm" and spec else None
    t = time.perf_counter()
    with ThreadPoolExecutor(args.batch) as pool:
        res = list(pool.map(one, prompts))
    dt = time.perf_counter() - t
    tokens = sum(r[0] for r in res)
    accept, tau, why, own = None, None, None, None
    if not spec:
        why = "no drafter"
    elif args.engine == "sglang":
        if any(r[1] is None for r in res):
            why = "a reply had no spec_verify_ct: speculation did not run"
        else:
            verifies = sum(r[1] for r in res)
            accept = (tokens - len(res)) / max(1, verifies)
            tau = tokens / (verifies + len(res))
            vals = [r[2] for r in res if r[2] is not None]
            own = round(sum(vals) / len(vals), 3) if vals else None
    else:
        acc, drafts = (counter(args.url, n) - b for n, b in zip(VLLM_COUNTERS, before))
        if drafts > 0:
            accept = 1 + acc / drafts
            tau = tokens / (drafts + len(res))
        else:
            why = "no drafts counted: speculation did not run"
    print(json.dumps({"engine": args.engine, "config": args.config, "prompts": args.prompts, "batch": args.batch,
                      "requests": len(res), "skipped": skipped, "output_tokens": tokens, "seconds": round(dt, 2),
                      "output_tok_s": round(tokens / dt, 1),
                      "accept_length": None if accept is None else round(accept, 3),
                      "tau": None if tau is None else round(tau, 3), "why_none": why,
                      "engine_spec_accept_length": own}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
