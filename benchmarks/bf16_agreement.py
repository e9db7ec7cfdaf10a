"""Does the width of a verify forward change greedy decisions in bf16? (issue 14 item 6)

    PYTHONPATH=src python benchmarks/bf16_agreement.py [--target smollm2-135m] [--dtype bf16] [--widths 1,6,61]

Speculative decoding checks a draft with ONE target forward over S tokens; plain decoding runs S = 1 forwards.
With exact arithmetic both give the same logits at a position. In bf16 the kernels a forward picks, and so the
rounding, depend on its shape. This measures that effect alone, with no drafter: for each prompt, the target's
plain greedy continuation (S = 1 steps, the reference) is teacher-forced again in forwards of S consecutive
tokens, and the argmax at every position is compared with the reference token. Counted per width: positions
whose argmax differs, prompts with at least one difference, and the mean top-2 logit margin at the positions
that differ (near-ties flip). A tree verifies about 60 nodes at once, prompt lookup at most K + 1.

With --drafter, it also decodes every prompt with prompt lookup (K=5), the eagle chain (K=5) and the default
tree in the same dtype and counts, per method, the turns identical to the plain reference and the share of
verify forwards that carried at least one draft token (a forward wider than plain decoding's).

Prints a table and appends it, with date, machine and command, to BENCHMARKS.md (or --md).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import torch


def continuation(runner, prompt: list[int], n: int) -> list[int]:
    return runner.generate([prompt], n, window=0)[0]


@torch.no_grad()
def forced_argmax(runner, prompt: list[int], cont: list[int], S: int) -> tuple[list[int], list[float]]:
    """Argmax and top-2 margin of the target after prompt + cont[:j] for j = 1..len(cont)-1, the continuation
    fed in forwards of S tokens after the prompt's one prefill forward (as plain decoding prefills it)."""
    dev = runner.device
    toks = prompt + cont
    n0 = len(prompt)
    L = len(toks)
    cols = torch.arange(runner.cfg.max_seq, device=dev)
    # decode-step masks as plain decoding builds them (window=0): all max_seq slots on CUDA (one graph shape),
    # the used slots on the CPU; width 1 must then reproduce the reference exactly (the table's control row)
    span = (lambda s1: runner.cfg.max_seq) if dev.type == "cuda" else (lambda s1: s1)
    ids = torch.tensor([toks], device=dev)
    pos = torch.arange(n0, device=dev)[None]
    runner(ids[:, :n0], pos, pos, cols[None, None, :n0] <= pos[..., None])
    preds, margins = [], []
    for s0 in range(n0, L - 1, S):  # the forward whose first token is toks[s0] predicts toks[s0 + 1]
        s1 = min(L - 1, s0 + S)
        pos = torch.arange(s0, s1, device=dev)[None]
        logits, _ = runner(ids[:, s0:s1], pos, pos, cols[None, None, :span(s1)] <= pos[..., None])
        preds += logits[0].argmax(-1).tolist()  # as greedy decoding picks: the first of tied maxima
        top = logits[0].float().topk(2, dim=-1).values
        margins += (top[:, 0] - top[:, 1]).tolist()
    return preds, margins


def decode_methods(runner, target, drafter_dir, prompts, conts, n) -> list[tuple]:
    """Per method: (name, identical turns, mean identical prefix, share of verify forwards with drafts, tau)."""
    from eyas.decode.spec import SpecConfig, SpecDecoder
    from eyas.model.checkpoint import open_drafter

    drafter, _ = open_drafter(drafter_dir, target=target)
    out = []
    for name, cfg in (("lookup-5", SpecConfig(method="lookup", k=5)), ("eagle chain-5", SpecConfig(method="chain", k=5)),
                      ("eagle tree", SpecConfig(method="tree"))):
        dec = SpecDecoder(runner, None if name.startswith("lookup") else drafter, cfg)
        widths = []  # verify forward widths: root + draft nodes
        propose = dec._propose

        def record(toks, gen, propose=propose, widths=widths):
            d = propose(toks, gen)
            widths.append(len(d))
            return d
        dec._propose = record
        same = prefix = tokens = forwards = 0
        for p, ref in zip(prompts, conts):
            got, st = dec.generate(p, n)
            same += got == ref
            prefix += next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            tokens, forwards = tokens + st.tokens, forwards + st.target_forwards
        wide = sum(w > 1 for w in widths) / max(len(widths), 1)
        out.append((name, f"{same} of {len(prompts)}", f"{prefix / len(prompts):.1f} of {n}", f"{wide:.2f}",
                    f"{tokens / forwards:.2f}"))
        print(out[-1], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--prompts", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=400)
    ap.add_argument("--widths", default="1,6,61")
    ap.add_argument("--drafter", default=None, help="also decode with lookup, the eagle chain and the tree")
    ap.add_argument("--md", default="BENCHMARKS.md")
    args = ap.parse_args()
    from eyas.data.chat import encode_prompt
    from eyas.data.sources import load_prompts
    from eyas.target import load_target
    from eyas.target.runner import Runner

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target = load_target(args.target, device=dev, dtype=dtype)
    recs = load_prompts(args.prompts, limit=args.limit)
    prompts = [encode_prompt(target.tokenizer, [{"role": "user", "content": r["turns"][0]}])[-args.max_prompt_tokens:]
               for r in recs]
    from eyas.decode.spec import SpecConfig

    room = max(SpecConfig(method="tree").draft_size, 5) + 2  # the --drafter decodes: a tree verifies 60 drafts
    runner = Runner.from_hf(target.model, max_batch=1, max_seq=args.max_prompt_tokens + args.max_new_tokens + room)
    conts = [continuation(runner, p, args.max_new_tokens) for p in prompts]
    rows = []
    for S in [int(w) for w in args.widths.split(",")]:
        diff = positions = prompts_hit = 0
        flip_margins, all_margins = [], []
        for p, c in zip(prompts, conts):
            preds, margins = forced_argmax(runner, p, c, S)
            bad = [j for j, (a, b) in enumerate(zip(preds, c[1:])) if a != b]
            diff += len(bad)
            positions += len(preds)
            prompts_hit += bool(bad)
            flip_margins += [margins[j] for j in bad]
            all_margins += margins
        mean_flip = sum(flip_margins) / len(flip_margins) if flip_margins else float("nan")
        rows.append((S, diff, positions, prompts_hit, len(prompts), mean_flip, sum(all_margins) / len(all_margins)))
        print(rows[-1], flush=True)
    decoded = decode_methods(runner, target, args.drafter, prompts, conts, args.max_new_tokens) if args.drafter else []
    machine = torch.cuda.get_device_name() if dev.type == "cuda" else (platform.processor() or "cpu")
    table = (f"\n## Verify width and greedy agreement ({args.dtype}), "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
             f"- machine: {machine}; torch {torch.__version__}; threads {torch.get_num_threads()}\n"
             f"- command: `{' '.join(['python'] + sys.argv)}`\n"
             f"- target {args.target} in {args.dtype}; {len(prompts)} prompts of {args.prompts} (first turns, at most "
             f"{args.max_prompt_tokens} tokens); reference: plain greedy, {args.max_new_tokens} new tokens, S = 1 "
             f"steps; each width re-reads that continuation in forwards of S tokens\n\n"
             "| forward width S | positions whose argmax differs | prompts with a difference | mean top-2 margin "
             "there | mean top-2 margin, all positions |\n|---|---|---|---|---|\n"
             + "".join(f"| {S} | {d} of {n} | {h} of {m} | {fm:.3f} | {am:.3f} |\n" for S, d, n, h, m, fm, am in rows)
             + ("" if not decoded else
                f"\nDecoded with {args.drafter} in {args.dtype}, against the same plain reference:\n\n"
                "| method | turns identical to plain | mean identical prefix | verify forwards carrying drafts | tau |\n"
                "|---|---|---|---|---|\n" + "".join(f"| {a} | {b} | {c} | {d} | {e} |\n" for a, b, c, d, e in decoded)))
    print(table)
    with open(args.md, "a") as f:
        f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
