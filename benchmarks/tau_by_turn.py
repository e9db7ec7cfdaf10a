"""Chain tau by assistant turn on the training eval's own conversations (issue 12: the train/decode gap).

    PYTHONPATH=src python benchmarks/tau_by_turn.py --prepared RUN/prepared --drafter RUN/export [--limit 30]

The training eval replays chains over every assistant turn of its held-out conversations (up to three per
conversation, later turns with the earlier regenerated replies in context); `eyas bench` decodes first turns
only. This decodes each turn of the first `--limit` training-eval conversations (train.data.is_eval, the
trainer's split) with real speculative chains: the prompt is the conversation up to that reply, as the training
sample holds it, and the reply is the target's own greedy continuation (at most --max-new-tokens). Reported per
turn index: turns, tokens, target forwards and tau = tokens / forwards. One conversation part per ShareGPT chat.

Prints a table and appends it, with date, machine and command, to BENCHMARKS.md (or --md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepared", required=True, help="an eyas prepare output directory (samples.jsonl)")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--limit", type=int, default=30, help="training-eval conversations decoded (distinct chats)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--eval-fraction", type=float, default=0.05, help="the training run's eval_fraction")
    ap.add_argument("--md", default="BENCHMARKS.md")
    args = ap.parse_args()
    from eyas.data.split import split_key
    from eyas.decode.spec import SpecConfig, SpecDecoder
    from eyas.model.checkpoint import open_drafter
    from eyas.target import load_target
    from eyas.target.runner import Runner
    from eyas.train.data import is_eval

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, device=dev, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
    drafter, _ = open_drafter(args.drafter, target=target)
    samples, chats = [], set()
    with open(Path(args.prepared) / "samples.jsonl") as f:
        for line in f:  # one part per ShareGPT chat (its parts `<id>_N` follow each other and share the split)
            r = json.loads(line)
            chat = split_key(r["id"], sharegpt=True)
            if is_eval(r["id"], args.eval_fraction) and chat not in chats:
                chats.add(chat)
                samples.append(r)
            if len(samples) == args.limit:
                break
    longest = max(s for r in samples for s, _ in r["trainable"])
    runner = Runner.from_hf(target.model, max_batch=1, max_seq=longest + args.max_new_tokens + args.k + 2)
    dec = SpecDecoder(runner, drafter, SpecConfig(method="chain", k=args.k))
    eos = target.eos_token_ids
    by_turn: dict[int, list[int]] = {}  # turn index -> [turns, tokens, target forwards]
    for r in samples:
        for j, (start, _end) in enumerate(r["trainable"], start=1):
            out, st = dec.generate(r["input_ids"][:start], args.max_new_tokens, eos_ids=eos)
            row = by_turn.setdefault(j, [0, 0, 0])
            row[0] += 1
            row[1] += st.tokens
            row[2] += st.target_forwards
        print(r["id"], {j: round(t / f, 3) for j, (_, t, f) in sorted(by_turn.items())}, flush=True)
    total = [sum(v[i] for v in by_turn.values()) for i in range(3)]
    first = by_turn.get(1, [0, 0, 1])
    machine = torch.cuda.get_device_name() if dev.type == "cuda" else (platform.processor() or "cpu")
    table = (f"\n## Chain tau by assistant turn, training-eval conversations, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
             f"- machine: {machine}; torch {torch.__version__}; {args.dtype}; threads {torch.get_num_threads()}\n"
             f"- command: `{' '.join(['python'] + sys.argv)}`\n"
             f"- {len(samples)} conversations of the training eval split of {args.prepared}; chain-{args.k}; each turn's "
             f"prompt as the training sample holds it, at most {args.max_new_tokens} new tokens\n\n"
             "| assistant turn | turns | tokens | target forwards | tau |\n|---|---|---|---|---|\n"
             + "".join(f"| {j} | {n} | {t} | {f} | {t / f:.2f} |\n" for j, (n, t, f) in sorted(by_turn.items()))
             + f"| all | {total[0]} | {total[1]} | {total[2]} | {total[1] / total[2]:.2f} |\n\n"
             f"- all turns / first turns: {total[1] / total[2] / (first[1] / first[2]):.3f}\n")
    print(table)
    with open(args.md, "a") as f:
        f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
