"""A tiny random DeepSeek-V3 "twin" of Kimi-K2 / Kimi-K2.5's language model, built with transformers' own
DeepseekV3ForCausalLM: MLA (q and kv LoRA ranks), MoE with shared and routed experts after
`first_k_dense_replace` dense layers, YaRN RoPE, an untied LM head, and a byte-level BPE tokenizer with a chat
template. `save_twin` writes it as a sharded HF directory (safetensors index) with the config keys SGLang's
deepseek_v2.py reads and transformers' config class lacks (topk_method, scoring_func, moe_layer_freq).

    python tests/support/deepseek_twin.py OUT [--live]     # --live: the sizes SGLang's MLA kernels take (GPU twin)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from eyas.target.slim import slim_copy

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. Hello there, how are you today?",
          "user assistant system def main(): return 42  # code\n\n  indented text, numbers 1234567890",
          "Paris is the capital of France. Speculative decoding drafts tokens; the target verifies."] * 20
# SGLang's DeepseekV2 reads these from config.json; transformers' DeepseekV3Config does not keep them all.
SGLANG_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "n_group": 1,
               "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0}
# The tensors every stage but the forward needs: embedding, final norm, LM head.
HEAD_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def twin_tokenizer(vocab_size: int = 320):
    """A small byte-level BPE tokenizer trained offline on a fixed corpus (deterministic), with chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = TEMPLATE
    return hf


def twin_config(*, live: bool = False, vocab_size: int = 320, layers: int = 7):
    """DeepseekV3Config of the twin. live=False: CPU-test sizes; live=True: MLA dims SGLang's kernels take
    (kv_lora_rank 512, rope 64, nope 128, v 128, as DeepSeek-V3 and Kimi-K2)."""
    from transformers import DeepseekV3Config

    dims = (dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                 q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
            if live else
            dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                 q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16))
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 50000.0}
    cfg = DeepseekV3Config(vocab_size=vocab_size, num_hidden_layers=layers, num_key_value_heads=dims[
        "num_attention_heads"], n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters=rope, **dims)
    return cfg


def make_twin(*, live: bool = False, seed: int = 0, layers: int = 7):
    """(DeepseekV3ForCausalLM in fp32 eval mode, tokenizer). Router biases and RMSNorm weights are random too, so
    routing is not degenerate and a pre-norm state is not a scaled post-norm one (as in a trained model)."""
    from transformers import DeepseekV3ForCausalLM

    tok = twin_tokenizer()
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(twin_config(live=live, vocab_size=len(tok), layers=layers)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name and name.endswith(".weight"):
                p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def save_twin(out, *, live: bool = False, seed: int = 0, layers: int = 7, dtype=torch.float32,
              max_shard_size: str = "200KB") -> Path:
    """Write the twin as a sharded HF directory: config.json (plus SGLang's keys), tokenizer, generation
    config, model.safetensors.index.json and shards (small, so the head tensors sit apart from the layers)."""
    out = Path(out)
    model, tok = make_twin(live=live, seed=seed, layers=layers)
    model.to(dtype)
    model.config.architectures = ["DeepseekV3ForCausalLM"]
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(SGLANG_KEYS)
    # Real DeepSeek-V3 / Kimi configs spell RoPE the transformers-4 way (rope_theta + rope_scaling "type"), which
    # engines that predate rope_parameters read.
    rope = dict(cfg.get("rope_parameters") or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def weightless_copy(full, out) -> Path:
    """`eyas target slim`'s copy of a sharded target directory: config, tokenizer, index and the shard(s) with
    HEAD_TENSORS, what every stage except the target's forward needs."""
    slim_copy(full, out)
    return Path(out)


if __name__ == "__main__":
    save_twin(sys.argv[1], live="--live" in sys.argv, dtype=torch.bfloat16 if "--live" in sys.argv else torch.float32)
    print(sys.argv[1])
