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


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (256 byte tokens, <|im_start|> 256, <|im_end|> 257 = eos) and a
    ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<|im_start|>": 256, "<|im_end|>": 257})
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", bos_token="<|im_start|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def tiny_byte_target_and_drafter():
    """A tiny random Llama (vocabulary 258, eos 257) behind byte_tokenizer as an eyas Target (aux layers 1, 2, 3),
    and an untrained EAGLE-3 drafter for it over the whole vocabulary."""
    from eyas.model.drafter import DrafterConfig, Eagle3Drafter
    from eyas.target import target_from_model

    model = make_tiny_llama(vocab=258, seed=31)
    model.config.eos_token_id = 257
    model.generation_config.eos_token_id = 257
    target = target_from_model(model, byte_tokenizer(), name="tiny", aux_layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=258, aux_layer_ids=(1, 2, 3)))
    return target, drafter.eval()
