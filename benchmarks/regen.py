"""Regeneration throughput: `Runner.generate` as prepare's regeneration runs it, old way vs new way, one process.

    python -m benchmarks.regen                   # GPU: SmolLM2-shaped, 1024 prompts, batch 512
    python -m benchmarks.regen --device cpu --dtype fp32 --prompts 12 --batch 6 --max-new 24 \
        --max-seq 160 --no-record                 # smoke test

A random-weight SmolLM2-shaped target (speed does not depend on the weights) samples at temperature 1 over
a near-flat distribution; `--eos` random token ids act as end-of-turn, so reply lengths are geometric
(mean about vocab / eos tokens, capped at --max-new) like real replies of mixed length. Prompt lengths are
drawn log-uniformly from --prompt-len. Each mode decodes the same prompts; the table gives generated
tokens/s and the ratio to the first mode ("full": every step attends all max_seq slots and the whole batch
runs until its last row ends; "window+compact": the default). Appends a dated section to BENCHMARKS.md
(benchmarks.record: --md FILE, --no-record).

    python -m benchmarks.regen --modes window+compact --profile   # what bounds a decode step

--profile then decodes the prompts once more in --profile-mode and, inside the first chunk, times --profile-steps
decode steps after --profile-skip steps, then profiles as many more with torch.profiler. Per decode step it prints
the wall time, the device's busy time (sum of kernel times) and idle share (the host's part), the kernels and the
host's launch calls and waits, the top kernels grouped into attention / matmul / elementwise+other, and the bytes
the step must move (weights, the K/V window of its rows, the logits) against the device's measured copy bandwidth:
the tok/s that bandwidth allows beside the measured tok/s.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from benchmarks import record
from benchmarks.capture import smollm2_shaped
from benchmarks.profiling import activities, by_kernel, copy_bandwidth, device_work, group, host_calls, sync
from eyas.target.runner import Runner

MODES = {"full": dict(window=0, compact=False, lengths=False), "window": dict(window=256, compact=False, lengths=False),
         "window+compact": dict(window=256, compact=True, lengths=False),
         "lengths": dict(window=256, compact=True, lengths=True),
         "compiled": dict(window=256, compact=True), "compiled+regions": dict(window=256, compact=True),
         "fused": dict(window=256, compact=True, lengths=True)}
"""full / window / window+compact: decode steps over a bool mask of every slot, of the chunk's window, and with
compaction. lengths: window+compact whose steps pass the rows' prefix lengths instead (flex attention reading only
each row's own key/value blocks; generate's default on CUDA). compiled: window+compact on a runner whose decode step
is torch.compile'd with dynamic shapes (prepare --regen-compile); its compile time is in the warm-up column.
compiled+regions: the same with the decoder layer compiled once for all layers (Runner.from_hf regions=True).
(A compiled runner refuses steps by lengths: Runner.graphed.) fused: lengths on a runner whose layers' norms,
projections, RoPE and MLP are compiled around the eager attention (Runner.from_hf fuse=True, prepare --regen-fuse);
its compile time is in the warm-up column.
The table's prefill column is the time inside generate's prefills (device-synced at both ends)."""


def tiny_shaped(device: str, dtype: torch.dtype):
    """A random-weight 3-layer Llama of a few hundred tokens' vocabulary: --shape tiny, for tests on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target import target_from_model

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return target_from_model(model, name="tiny (random weights)")


def step_bytes(runner: Runner, rows: int, slots: int) -> dict[str, int]:
    """Bytes one decode step of `rows` rows attending `slots` cache slots must move at least: every weight once
    (of the embedding only the rows' own entries), each row's K/V over the slots in every layer, and the logits,
    written by the head and read once by the sampler. Left out: the new K/V entries, the small tensors, and the
    additive attention mask, which each layer reads at most once per kv head (num_heads / kv_heads / (2 x head_dim)
    of the K/V bytes)."""
    c, e = runner.cfg, runner.embed.weight.element_size()
    weights = sum(p.numel() * p.element_size() for n, p in runner.named_parameters() if not n.startswith("embed."))
    return {"weights": weights + rows * c.hidden_size * e,
            "kv": int(rows * c.num_layers * 2 * c.num_kv_heads * slots * c.head_dim * e),
            "logits": 2 * rows * c.vocab_size * e}


class PrefillClock:
    """Seconds spent in `generate`'s prefills while in the `with` block, synced with the device at both ends."""

    def __enter__(self):
        import eyas.target.generate as gen

        self.mod, self.orig, self.s = gen, gen.prefill, 0.0

        def timed(runner, *args, **kw):
            sync(runner.device)
            t = time.perf_counter()
            out = self.orig(runner, *args, **kw)
            sync(runner.device)
            self.s += time.perf_counter() - t
            return out

        gen.prefill = timed
        return self

    def __exit__(self, *exc):
        self.mod.prefill = self.orig


class StepProbe:
    """Wraps the decode steps `Runner.graphed` hands out. Of the decode steps (counted over the whole call) it
    times [skip, skip+steps) unprofiled, the forward itself with CUDA events (a plain timer on the CPU), then
    profiles [skip+steps, skip+2*steps); each window's wall time runs from a device sync at its first step to one at
    the step after its last, so it covers the loop's host work between steps too. It records every step's (rows,
    slots): a step by lengths (Runner.forward) reads its rows' mean length, kept on the device until `sizes`."""

    def __init__(self, device: torch.device, skip: int, steps: int):
        self.device, self.bounds = device, (skip, skip + steps, skip + 2 * steps)
        self.shapes: list[tuple[int, int]] = []
        self.fwd: list = []  # per timed step: (start, end) CUDA events, or seconds on the CPU
        self.wall: dict[str, float] = {}
        self.prof = None
        self.t0 = 0.0

    def wrap(self, step):
        def run(ids, pos, slots, mask):
            i = len(self.shapes)
            self.shapes.append((ids.shape[0], mask.float().mean() if mask.dtype == torch.long else mask.shape[-1]))
            a, b, c = self.bounds
            if i in self.bounds:
                sync(self.device)
                now = time.perf_counter()
                if i == b:
                    self.wall["timed"] = now - self.t0
                    self.prof = torch.profiler.profile(activities=activities(self.device))
                    self.prof.start()
                    now = time.perf_counter()
                if i == c:
                    self.wall["profiled"] = now - self.t0
                    self.prof.stop()
                self.t0 = now
            if not a <= i < b:
                return step(ids, pos, slots, mask)
            if self.device.type == "cuda":
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
                out = step(ids, pos, slots, mask)
                ev[1].record()
                self.fwd.append(ev)
                return out
            t = time.perf_counter()
            out = step(ids, pos, slots, mask)
            self.fwd.append(time.perf_counter() - t)
            return out
        return run

    def sizes(self) -> list[tuple[int, float]]:
        """(rows, slots) of every step, as numbers."""
        return [(r, float(s)) for r, s in self.shapes]

    def forward_s(self) -> float:
        """Total forward time of the timed steps, in seconds."""
        if self.device.type == "cuda":
            return sum(a.elapsed_time(b) for a, b in self.fwd) / 1e3
        return sum(self.fwd)


def profile_mode(runner: Runner, prompts, eos, a, name: str) -> dict:
    """Decode `prompts` once more with a StepProbe in place, and gather what the section reports."""
    dev = runner.device
    skip, n = a.profile_skip, a.profile_steps
    bw = copy_bandwidth(dev, a.bw_mib)
    with torch.profiler.profile(activities=activities(dev)):  # start the profiler's machinery once, untimed
        torch.ones(8, device=dev).add_(1)
        sync(dev)
    probe = StepProbe(dev, skip, n)
    graphed = runner.graphed
    runner.graphed = lambda *args, **kw: probe.wrap(graphed(*args, **kw))
    try:
        sync(dev)
        t0 = time.perf_counter()
        out = runner.generate(prompts, a.max_new, temperature=1.0, eos_ids=eos, seed=0, **MODES[name])
        sync(dev)
        run_s = time.perf_counter() - t0
    finally:
        del runner.graphed
        if probe.prof is not None and "profiled" not in probe.wall:
            probe.prof.stop()
    if "profiled" not in probe.wall:
        raise SystemExit(f"regen --profile: the run made {len(probe.shapes)} decode steps, the windows need "
                         f"{skip + 2 * n} (--profile-skip {skip} + 2 x --profile-steps {n}); raise --max-new")
    shapes = probe.sizes()
    win = shapes[skip:skip + 2 * n]
    rows = sum(r for r, _ in win) / len(win)
    slots = sum(s for _, s in win) / len(win)
    per = [step_bytes(runner, r, s) for r, s in win]
    moved = {k: sum(p[k] for p in per) // len(per) for k in per[0]}
    work = device_work(probe.prof, dev)
    launches, graphs, waits = host_calls(probe.prof)
    groups: dict[str, float] = {}
    for kname, us in work:
        groups[group(kname)] = groups.get(group(kname), 0.0) + us
    run_bytes = sum(sum(step_bytes(runner, r, s).values()) for r, s in shapes)
    return {"mode": name, "layers": runner.cfg.num_layers, "skip": skip, "steps": n, "rows": rows, "slots": slots,
            "bw": bw,
            "wall_ms": 1e3 * probe.wall["timed"] / n, "wall_prof_ms": 1e3 * probe.wall["profiled"] / n,
            "forward_ms": 1e3 * probe.forward_s() / n, "busy_ms": sum(us for _, us in work) / 1e3 / n,
            "kernels": len(work) / n, "launches": launches / n, "graph_launches": graphs / n,
            "waits": {k: v / n for k, v in waits.items()}, "groups": {k: v / 1e3 / n for k, v in groups.items()},
            "top": [(k, c / n, us / 1e3 / n) for k, c, us in by_kernel(work)[:a.profile_top]],
            "bytes": moved, "tokens": sum(map(len, out)), "run_s": run_s, "row_steps": sum(r for r, _ in shapes),
            "decode_steps": len(probe.shapes), "run_bytes": run_bytes}


def profile_markdown(p: dict, dev_kind: str) -> str:
    """The --profile section's body: three small tables and the bandwidth and whole-run lines."""
    busy, wall = p["busy_ms"], p["wall_prof_ms"]
    w = p["waits"]
    unit = "kernels (memcpy, memset included)" if dev_kind == "cuda" else "aten ops"  # CPU: the ops are its work
    lines = [
        f"Mode {p['mode']}: decode steps {p['skip']}-{p['skip'] + p['steps'] - 1} timed, "
        f"{p['skip'] + p['steps']}-{p['skip'] + 2 * p['steps'] - 1} profiled; {p['rows']:g} rows per step "
        f"over {p['slots']:g} cache slots." + ("" if dev_kind == "cuda" else " The CPU is the device here: its "
                                                "work is the aten ops' self time."), "",
        "| per decode step | value |", "|---|---|",
        f"| wall ms (timed window) | {p['wall_ms']:.3f} |",
        f"| wall ms (profiled window) | {wall:.3f} |",
        f"| forward ms (timed window, {'CUDA events' if dev_kind == 'cuda' else 'timer'} around the step's call) | "
        f"{p['forward_ms']:.3f} |",
        f"| device busy ms (sum of {unit}) | {busy:.3f} |",
        f"| device idle share (host bound) | {1 - busy / wall:.1%} |",
        f"| {unit} | {p['kernels']:.1f} |",
        f"| host launch calls (of them graph launches) | {p['launches']:.2f} ({p['graph_launches']:.2f}) |",
        f"| host waits: cudaStreamSynchronize / cudaEventSynchronize | {w['cudaStreamSynchronize']:.3f} / "
        f"{w['cudaEventSynchronize']:.3f} |",
        f"| aten::item / aten::nonzero | {w['aten::item']:.3f} / {w['aten::nonzero']:.3f} |",
        f"| measured tok/s (rows / timed wall; finished rows still computed count) | "
        f"{p['rows'] / p['wall_ms'] * 1e3:,.0f} |", "",
        "| group | ms per step | share of busy |", "|---|---|---|"]
    lines += [f"| {g} | {ms:.3f} | {ms / max(busy, 1e-9):.0%} |"
              for g, ms in sorted(p["groups"].items(), key=lambda kv: -kv[1])]
    lines += ["", "| top kernel | group | per step | ms per step |", "|---|---|---|---|"]
    for k, c, ms in p["top"]:
        short = (k[:70] + "...") if len(k) > 73 else k
        lines.append(f"| `{short.replace('|', '/')}` | {group(k)} | {c:.1f} | {ms:.3f} |")
    b = p["bytes"]
    total = sum(b.values())
    bound_ms = total / p["bw"] * 1e3
    lines += ["", "| bytes a step moves | bytes |", "|---|---|",
              f"| weights (incl. {p['rows']:g} embedding rows) | {b['weights']:,} |",
              f"| K/V window: {p['rows']:g} rows x {p['slots']:g} slots | {b['kv']:,} |",
              f"| logits: written, read once by sampling | {b['logits']:,} |",
              f"| total | {total:,} |", "",
              f"Copy bandwidth {p['bw'] / 1e9:,.1f} GB/s (one device-to-device copy, read + write). At it a step "
              f"takes at least {bound_ms:.3f} ms: **{p['rows'] / bound_ms * 1e3:,.0f} tok/s bandwidth-bound vs "
              f"{p['rows'] / p['wall_ms'] * 1e3:,.0f} measured** ({bound_ms / p['wall_ms']:.0%} of the bound).", "",
              f"Whole profiled call: {p['tokens']:,} tokens in {p['run_s']:.2f} s ({p['tokens'] / p['run_s']:,.0f} "
              f"tok/s, prefill included); {p['decode_steps']} decode steps computed {p['row_steps']:,} row-steps "
              f"({p['tokens'] / p['row_steps']:.0%} of them kept); their bytes at the copy bandwidth take "
              f"{p['run_bytes'] / p['bw']:.3g} s ({p['run_bytes'] / p['bw'] / p['run_s']:.0%} of the call)."]
    if dev_kind == "cuda" and p["kernels"] < p["layers"]:
        lines += ["", f"**The profiler saw {p['kernels']:.1f} kernels per step, fewer than the {p['layers']} layers: "
                  "its device times are incomplete (were the graph's kernels traced?); the forward ms from CUDA "
                  "events stands.**"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--shape", default="smollm2", choices=["smollm2", "tiny"], help="the random-weight target")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512, help="rows per generation forward (prepare's gen_batch)")
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--max-seq", type=int, default=2432, help="cache slots per row (prepare: max_len + max_new)")
    ap.add_argument("--prompt-len", default="30,1800", help="LO,HI: log-uniform prompt lengths")
    ap.add_argument("--eos", type=int, default=160, help="random token ids that end a reply")
    ap.add_argument("--modes", default="full,window+compact", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--profile", action="store_true", help="then profile steady-state decode steps (module doc)")
    ap.add_argument("--profile-mode", default="window+compact", choices=list(MODES))
    ap.add_argument("--profile-skip", type=int, default=32, help="decode steps before the timed window")
    ap.add_argument("--profile-steps", type=int, default=32, help="steps in the timed and in the profiled window")
    ap.add_argument("--profile-top", type=int, default=10, help="kernels listed by time")
    ap.add_argument("--bw-mib", type=int, default=None, help="copy size of the bandwidth probe (default 1024 on "
                    "CUDA, 64 elsewhere)")
    record.add_options(ap)
    a = ap.parse_args(argv)
    a.bw_mib = a.bw_mib or (1024 if a.device.startswith("cuda") else 64)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    target = (smollm2_shaped if a.shape == "smollm2" else tiny_shaped)(a.device, dtype)
    lo, hi = map(int, a.prompt_len.split(","))
    hi = min(hi, a.max_seq - a.max_new)
    g = torch.Generator().manual_seed(0)
    V = target.model.config.vocab_size
    lens = [int(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * float(u))) for u in torch.rand(a.prompts, generator=g)]
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in lens]
    eos = torch.randint(3, V, (a.eos,), generator=g).tolist()
    runner = Runner.from_hf(target.model, max_batch=a.batch, max_seq=a.max_seq, dtype=dtype)
    cuda = a.device.startswith("cuda")
    rows, warm, runners = [], {}, {}

    def ready(name):
        """The runner for mode `name`, warmed up (graphs, compilation)."""
        if name not in runners:
            if name == "fused":
                runners[name] = Runner.from_hf(target.model, max_batch=a.batch, max_seq=a.max_seq, dtype=dtype,
                                               fuse=True)
            else:
                runners[name] = runner if not name.startswith("compiled") else Runner.from_hf(
                    target.model, max_batch=a.batch, max_seq=a.max_seq, dtype=dtype, compile=True,
                    dynamic=True, regions=name == "compiled+regions")
        r = runners[name]
        if name not in warm:
            t0 = time.perf_counter()
            r.generate(prompts[:a.batch], 20, temperature=1.0, eos_ids=eos, seed=1, **MODES[name])
            sync(r.device)
            warm.setdefault(name, time.perf_counter() - t0)
        return r

    for name in [m for m in a.modes.split(",") if m]:
        r = ready(name)
        with PrefillClock() as pre:
            t0 = time.perf_counter()
            out = r.generate(prompts, a.max_new, temperature=1.0, eos_ids=eos, seed=0, **MODES[name])
            sync(r.device)
            dt = time.perf_counter() - t0
        new = sum(map(len, out))
        rows.append((name, new, dt, new / dt, pre.s))
        print(f"{name}: {new} tokens in {dt:.1f} s ({pre.s:.1f} s prefill) = {new / dt:,.0f} tok/s", flush=True)
    prof = profile_mode(ready(a.profile_mode), prompts, eos, a, a.profile_mode) if a.profile else None
    mean_prompt = sum(lens) / len(lens)
    setup = (f"{a.prompts} prompts (mean {mean_prompt:.0f} tokens, log-uniform {lo}-{hi}), batch {a.batch}, "
             f"max_new {a.max_new}, cache {a.max_seq} slots, {a.dtype}, temperature 1 with {a.eos} eos ids")
    body = []
    if rows:
        base = rows[0][3]
        table = ("| mode | warm-up s | generated tokens | seconds | of them prefill | tok/s | vs " + rows[0][0]
                 + " |\n|---|---|---|---|---|---|---|\n"
                 + "\n".join(f"| {n} | {warm[n]:.1f} | {t:,} | {s:.1f} | {p:.1f} | {r:,.0f} | {r / base:.2f}x |"
                             for n, t, s, r, p in rows))
        body += [table, f"{setup} (mean reply {sum(r[1] for r in rows) / len(rows) / a.prompts:.0f} tokens)."]
    if prof is not None:
        body += ["### Decode step profile", profile_markdown(prof, "cuda" if cuda else "cpu")]
        if not rows:
            body.append(setup + ".")
    text = "\n\n".join(body)
    print(text)
    record.write(a, "Regeneration throughput", text, command=record.command_line(__spec__.name, argv),
                 machine=record.device_name(a.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
