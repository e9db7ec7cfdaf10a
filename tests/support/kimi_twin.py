"""A tiny random Kimi-K2.5 checkpoint (`KimiK25ForConditionalGeneration`): the DeepSeek-V3 twin of
deepseek_twin.py as its language model, under `language_model.` (one more vocabulary row, for the image token),
a one-block MoonViT vision tower and the patch-merger projector, named and shaped as SGLang 0.5.14's kimi_k25.py
loads them (the real checkpoint's spelling: blocks' `wqkv`/`wo`, projector `proj.0`/`proj.2`).

The directory: config.json (`text_config` = the twin's config with SGLang's keys, model_type kimi_k2 as Kimi's;
`vision_config` with both the vt_* keys of Kimi's config and the keys SGLang's vision classes read), the sharded
safetensors with index (the head tensors in shards of their own), the twin's tokenizer plus `<|media_pad|>`, a
chat template that also renders content lists (image parts as `<|media_pad|>`), and the processor SGLang's
multimodal start-up asks for (tests/support/kimi_twin_processing.py as remote code named by processor_config.json:
SGLang serves it only with --trust-remote-code, like Kimi-K2.5).

The language model's tensors are the DeepSeek twin's (same seed and sizes) bit for bit, plus the image token's
row, so states captured through this wrapper compare with the DeepSeek twin run in process.

    python tests/support/kimi_twin.py OUT [--live]     # --live: the twin's MLA sizes SGLang's kernels take, bf16
    python tests/support/kimi_twin.py OUT --from TWIN  # around a DeepSeek twin directory already written
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

if __package__:
    from .deepseek_twin import save_twin
else:   # run as a script: deepseek_twin.py beside it
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from deepseek_twin import save_twin  # noqa: E402

MEDIA_PAD = "<|media_pad|>"   # the image placeholder SGLang's Kimi processor looks for (processors/kimi_k25.py)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}" + MEDIA_PAD + "{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# MoonViT: one block, head dim 32 (SGLang's 2D RoPE needs a multiple of 4); a 4x4 position grid, the grid of
# SGLang's warm-up image (32x32 -> padded to 56x56 -> 4x4 patches of 14), so no interpolation runs for it.
VISION = {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 4,
          "pos_emb_type": "divided_fixed", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
          "intermediate_size": 128, "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal",
          "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu",
          "projector_ln_eps": 1e-5}
# The media settings SGLang's Kimi processor reads at start-up and preprocesses GPU images with (the twin's values).
MEDIA_PROC_CFG = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
PROCESSOR_FILE = "processing_kimi_twin.py"
PREFIX = "language_model."
# The head tensors as a Kimi-K2.5 checkpoint names them.
HEAD_TENSORS = tuple(PREFIX + n for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"))


def vision_config(text_hidden: int) -> dict:
    v = dict(VISION)
    h = v["hidden_size"]
    v.update(vt_hidden_size=h, vt_intermediate_size=v["intermediate_size"], mm_hidden_size=h,
             vt_num_attention_heads=v["num_attention_heads"], vt_num_hidden_layers=v["num_hidden_layers"],
             text_hidden_size=text_hidden)
    return v


def vision_tensors(v: dict, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """Vision tower + projector, fp32, checkpoint names (SGLang renames wqkv/wo/proj.N on load)."""
    g = torch.Generator().manual_seed(seed)
    d, i, p, m = v["hidden_size"], v["intermediate_size"], v["patch_size"], 4   # m: 2x2 merged patches

    def rnd(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    t = {"vision_tower.patch_embed.proj.weight": rnd(d, 3, p, p), "vision_tower.patch_embed.proj.bias": rnd(d),
         "vision_tower.patch_embed.pos_emb.weight": rnd(v["init_pos_emb_height"], v["init_pos_emb_width"], d),
         "vision_tower.encoder.final_layernorm.weight": 1 + rnd(d), "vision_tower.encoder.final_layernorm.bias": rnd(d),
         "mm_projector.pre_norm.weight": 1 + rnd(d), "mm_projector.pre_norm.bias": rnd(d),
         "mm_projector.proj.0.weight": rnd(m * d, m * d), "mm_projector.proj.0.bias": rnd(m * d),
         "mm_projector.proj.2.weight": rnd(v["text_hidden_size"], m * d),
         "mm_projector.proj.2.bias": rnd(v["text_hidden_size"])}
    for b in range(v["num_hidden_layers"]):
        k = f"vision_tower.encoder.blocks.{b}."
        t |= {k + "norm0.weight": 1 + rnd(d), k + "norm0.bias": rnd(d), k + "norm1.weight": 1 + rnd(d),
              k + "norm1.bias": rnd(d), k + "wqkv.weight": rnd(3 * d, d), k + "wqkv.bias": rnd(3 * d),
              k + "wo.weight": rnd(d, d), k + "wo.bias": rnd(d), k + "mlp.fc0.weight": rnd(i, d),
              k + "mlp.fc0.bias": rnd(i), k + "mlp.fc1.weight": rnd(d, i), k + "mlp.fc1.bias": rnd(d)}
    return t


def write_shards(out: Path, groups: list[dict[str, torch.Tensor]], max_bytes: int) -> dict[str, str]:
    """Each group packed into shards of at most max_bytes (a group never shares a shard with another), plus
    model.safetensors.index.json; returns the weight map."""
    from safetensors.torch import save_file

    shards: list[dict] = []
    for group in groups:
        cur, size = {}, 0
        for name, t in group.items():
            nb = t.numel() * t.element_size()
            if cur and size + nb > max_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[name], size = t.contiguous(), size + nb
        if cur:
            shards.append(cur)
    wm, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            wm[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}, indent=2) + "\n")
    return wm


def save_kimi_twin(out, *, live: bool = False, seed: int = 0, layers: int = 7, dtype=torch.float32,
                   max_shard_size: int = 200_000) -> Path:
    """Write the Kimi-K2.5 twin to `out` (see the module docstring): save_twin's DeepSeek twin, wrapped."""
    with tempfile.TemporaryDirectory() as tmp:
        twin = save_twin(Path(tmp) / "twin", live=live, seed=seed, layers=layers, dtype=dtype)
        return wrap_twin(twin, out, seed=seed, max_shard_size=max_shard_size)


def wrap_twin(twin, out, *, seed: int = 0, max_shard_size: int = 200_000) -> Path:
    """The Kimi-K2.5 twin around an existing DeepSeek twin directory (deepseek_twin.save_twin's): its tensors
    under language_model. (plus the image token's row), its config as text_config, its tokenizer plus
    `<|media_pad|>`, and a vision tower and projector in its dtype. A twin staged on another machine is wrapped
    there, so the language model is bit for bit the one the in-process checks run."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    twin, out = Path(twin), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(twin))
    tok.add_tokens([MEDIA_PAD], special_tokens=True)
    tok.chat_template = TEMPLATE
    text = json.loads((twin / "config.json").read_text())
    lm = {}
    for f in sorted(twin.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            lm |= {k: sf.get_tensor(k) for k in sf.keys()}
    dtype = lm["model.embed_tokens.weight"].dtype
    extra = len(tok) - int(text["vocab_size"])          # the image token's row, drawn like the others
    g = torch.Generator().manual_seed(seed + 1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = lm[name]
        lm[name] = torch.cat([w, (torch.randn(extra, w.shape[1], generator=g) * w.float().std()).to(dtype)])
    text.update(vocab_size=len(tok), model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    v = vision_config(int(text["hidden_size"]))
    vis = {k: t.to(dtype) for k, t in vision_tensors(v, seed=seed + 2).items()}
    heads = {PREFIX + "model.embed_tokens.weight": lm.pop("model.embed_tokens.weight")}
    tail = {PREFIX + n: lm.pop(n) for n in ("model.norm.weight", "lm_head.weight")}
    write_shards(out, [heads, tail, {PREFIX + k: t for k, t in lm.items()}, vis], max_shard_size)
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
           "media_placeholder_token_id": tok.convert_tokens_to_ids(MEDIA_PAD), "ignore_index": -100,
           "tie_word_embeddings": False, "use_unified_vision_chunk": False,
           "video_placeholder": "<|kimi_k25_video_placeholder|>", "dtype": str(dtype).removeprefix("torch."),
           "text_config": text, "vision_config": v}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copy(twin / "generation_config.json", out / "generation_config.json")
    tok.save_pretrained(out)
    shutil.copy(Path(__file__).with_name("kimi_twin_processing.py"), out / PROCESSOR_FILE)
    (out / "processor_config.json").write_text(json.dumps(
        {"auto_map": {"AutoProcessor": PROCESSOR_FILE.removesuffix(".py") + ".KimiTwinProcessor"},
         "media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    return out


if __name__ == "__main__":
    live, args = "--live" in sys.argv, [a for a in sys.argv[1:] if a != "--live"]
    if "--from" in args:      # wrap an existing DeepSeek twin directory (its sizes and dtype)
        wrap_twin(args[args.index("--from") + 1], args[0])
    else:
        save_kimi_twin(args[0], live=live, dtype=torch.bfloat16 if live else torch.float32)
    print(args[0])
