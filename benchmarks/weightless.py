"""Peak memory of the stages that never load the target whole, on a weightless Kimi-K2-shaped directory.

    python -m benchmarks.weightless                     # vocab 163,840 x hidden 7168, bf16 heads
    python -m benchmarks.weightless --vocab 16384 --hidden 1024 --no-record   # smoke test

The script writes the directory itself: a Kimi-K2 text config (61 layers, MLA, 384 experts) with the given vocab and
hidden size, a small chat tokenizer (320 byte-level BPE tokens, ChatML's specials and template), an index naming
every layer tensor in shards that are absent, and the two shards holding the random bf16 head tensors (embedding
in the first, final norm and LM head in the last, as DeepSeek-V3/Kimi checkpoints place them), streamed to disk a
block of rows at a time.

Each stage runs in a fresh child process with its own empty hash cache (so its fingerprint hashes the head tensors
once, as a first run does); its peak RSS is the child's ru_maxrss (os.wait4). Stages:
- baseline: import torch, transformers and eyas, nothing else (the floor every stage pays);
- prepare: run_prepare of 16 conversations (no regeneration: tokenizer, config, fingerprint);
- train set-up: open_target_meta as offline `eyas train` opens it, in bf16 (the CUDA set-up; on a CPU the trainer
  asks for fp32, twice the bytes), then every byte of the tensors the trainer and --init-from-target read
  (embedding, LM head, final norm);
- export check: open_target_meta as `eyas export --target` opens it (tensors=(): fingerprint only).
Appends a dated section to BENCHMARKS.md (benchmarks.record: --md FILE, --no-record).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import record

ROOT = Path(__file__).resolve().parents[1]

# Kimi-K2's text config (moonshotai/Kimi-K2-Instruct config.json); vocab and hidden size come from the flags.
KIMI_K2 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
           "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
           "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
           "rope_theta": 50000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


# The tokenizer's chat template (ChatML) and the words of the conversations prepare reads.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "the quick brown fox jumps over lazy dog hello there paris capital france code return".split()


def conversations(n: int) -> list[dict]:
    """n records of 1-3 user/assistant turns of a few WORDS each, as prepare reads them from JSONL."""
    def text(i: int, n_words: int) -> str:
        return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n_words))

    return [{"id": f"c{i}", "messages": [m for t in range(1 + i % 3)
                                         for m in ({"role": "user", "content": text(i + t, 3 + i % 5)},
                                                   {"role": "assistant", "content": text(7 * i + t, 2 + i % 7)})]}
            for i in range(n)]


def chat_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on the conversations' text (deterministic), with ChatML's special tokens
    and chat template: prepare needs one; its size is nothing beside the head tensors."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for c in conversations(64) for m in c["messages"]], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def write_shard(path: Path, tensors: dict[str, tuple[tuple[int, ...], int]], block_rows: int = 4096) -> None:
    """A safetensors file of random bf16 tensors {name: (shape, seed)}, written a block of rows at a time (the
    values do not matter here, only the bytes)."""
    import torch

    header, off = {}, 0
    for name, (shape, _) in tensors.items():
        n = 2 * int(torch.tensor(shape).prod())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, (shape, seed) in tensors.items():
            g = torch.Generator().manual_seed(seed)
            rows, cols = shape[0], (shape[1] if len(shape) > 1 else 1)
            for r in range(0, rows, block_rows):
                # random bf16 bit patterns of values in [0, 2): finite, and cheaper than randn
                block = torch.randint(0, 1 << 14, (min(block_rows, rows - r), cols), generator=g,
                                      dtype=torch.int16)
                f.write(block.numpy().tobytes())


def make_target(d: Path, vocab: int, hidden: int) -> int:
    """Write the weightless directory; returns the bytes of its head tensors."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({**KIMI_K2, "vocab_size": vocab, "hidden_size": hidden}, indent=1))
    chat_tokenizer().save_pretrained(d)
    n = KIMI_K2["num_hidden_layers"]
    first, last = "model-00001-of-00064.safetensors", "model-00064-of-00064.safetensors"
    wm = {f"model.layers.{i}.{t}.weight": f"model-{2 + i:05d}-of-00064.safetensors"
          for i in range(n) for t in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj",
                                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                                      "post_attention_layernorm")}
    wm.update({"model.embed_tokens.weight": first, "model.norm.weight": last, "lm_head.weight": last})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    write_shard(d / first, {"model.embed_tokens.weight": ((vocab, hidden), 0)})
    write_shard(d / last, {"model.norm.weight": ((hidden,), 1), "lm_head.weight": ((vocab, hidden), 2)})
    return 2 * (2 * vocab * hidden + hidden)


def child(stage: str, d: str, work: str) -> None:
    """One stage, run in this (fresh) process."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import eyas.data.prepare  # noqa: F401
    import eyas.target.meta  # noqa: F401
    if stage == "baseline":
        return
    from eyas.target.meta import open_target_meta
    if stage == "prepare":
        from eyas.data.prepare import PrepareConfig, run_prepare
        data = Path(work) / "d.jsonl"
        data.write_text("".join(json.dumps(c) + "\n" for c in conversations(16)))
        run_prepare(PrepareConfig(target=d, data=str(data), out=str(Path(work) / "prep"), max_len=256),
                    progress=False)
    elif stage == "train set-up":
        t = open_target_meta(d, dtype=torch.bfloat16, aux_layer_ids=None)
        ws = [t.embed_tokens.weight, t.lm_head.weight, t.final_norm.weight]
        assert all(torch.isfinite(w.max()) for w in ws)   # every byte read, as the trainer's copy to the GPU does
    elif stage == "export check":
        open_target_meta(d, tensors=())


def run_child(stage: str, d: Path, work: Path) -> tuple[int, float]:
    """(peak RSS bytes, seconds) of a child process running `stage`."""
    env = dict(os.environ, EYAS_CACHE=str(work / "cache"), PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", __spec__.name, "--child", stage, "--dir", str(d), "--work", str(work)],
                         env=env)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"stage {stage!r} failed with exit code {p.returncode}")
    return usage.ru_maxrss * 1024, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dir", default=None, help="the target directory (default: written to a temp dir)")
    record.add_options(ap)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.dir, args.work)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="eyas-weightless-"))
    try:
        d = tmp / "kimi-k2-weightless"
        t0 = time.perf_counter()
        head = make_target(d, args.vocab, args.hidden)
        made = time.perf_counter() - t0
        rows, GiB = [], 1 << 30
        needs = {"baseline": 0, "prepare": 0, "train set-up": head, "export check": 0}
        for stage, need in needs.items():
            work = tmp / stage.replace(" ", "-")
            work.mkdir()
            rss, sec = run_child(stage, d, work)
            rows.append((stage, rss, sec, need))
        base = rows[0][1]
        lines = ["| stage | peak RSS | head tensors it holds | peak - baseline - held | seconds |",
                 "|---|---|---|---|---|"]
        for stage, rss, sec, need in rows:
            margin = "" if stage == "baseline" else f"{(rss - base - need) / GiB:+.2f} GiB"
            lines.append(f"| {stage} | {rss / GiB:.2f} GiB | {need / GiB:.2f} GiB | {margin} | {sec:.1f} |")
        table = "\n".join(lines)
        on_disk = sum(p.stat().st_size for p in d.iterdir())
        note = (f"Target: vocab {args.vocab:,} x hidden {args.hidden:,}, bf16 embedding + LM head + final norm "
                f"= {head / GiB:.2f} GiB ({on_disk / GiB:.2f} GiB on disk with config, tokenizer and index; "
                f"written in {made:.0f} s). Each stage is a fresh process with an empty hash cache, so prepare and "
                f"the export check include hashing the head tensors for the fingerprint (read in 4 MiB blocks).")
        print(table)
        print(note)
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
        record.write(args, "Weightless target, peak memory", f"{table}\n\n{note}",
                     command=record.command_line(__spec__.name),
                     machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, {mem:.0f} GiB RAM")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
