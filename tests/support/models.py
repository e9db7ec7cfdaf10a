"""Tiny random models built in the tests."""

import torch


def make_tiny_llama(*, layers=4, hidden=64, heads=4, kv_heads=2, vocab=256, inter=128,
                    tie=False, seed=0, max_pos=512, rope_theta=10000.0):
    """A tiny random HF LlamaForCausalLM in fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_theta=rope_theta, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model
