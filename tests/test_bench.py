"""eyas bench on a tiny random Llama with a byte-level tokenizer: report, lossless check, bad input."""

import argparse
import json

import pytest
import torch

from conftest import make_tiny_llama
from eyas.bench.bench import BenchConfig, run_bench
from eyas.bench.command import register
from eyas.errors import EyasError
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.target import target_from_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def byte_tokenizer():
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


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(vocab=258, seed=31)
    model.config.eos_token_id = 257
    model.generation_config.eos_token_id = 257
    target = target_from_model(model, byte_tokenizer(), name="tiny", aux_layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=258, aux_layer_ids=(1, 2, 3)))
    return target, drafter.eval()


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello there"}, {"turns": ["one", "two, again"]}, {"prompt": "x" * 300},
             {"prompt": "abcabcabcabc"}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_bench_report_lossless_and_files(tiny, prompts, tmp_path, capsys):
    target, drafter = tiny
    out = tmp_path / "r" / "bench.json"
    cfg = BenchConfig(prompts=prompts, k=3, max_new_tokens=12, max_seq=160, json_out=str(out))
    rep = run_bench(cfg, target=target, drafter=drafter)
    assert set(rep["methods"]) == {"plain", "lookup", "eagle-chain"}
    assert rep["records"] == 4 and rep["turns"] == 5 and rep["truncated"] == 1
    assert rep["methods"]["plain"]["tau"] == 1.0
    for name in ("lookup", "eagle-chain"):
        m = rep["methods"][name]
        assert rep["lossless"][name]["held"] and rep["lossless"][name]["identical_turns"] == 5
        assert len(m["acceptance_by_position"]) == 3 and m["tau"] >= 1.0 and "speedup" in m
        assert m["tokens"] == rep["methods"]["plain"]["tokens"]
    assert json.loads(out.read_text())["methods"]["eagle-chain"]["tau"] == rep["methods"]["eagle-chain"]["tau"]
    assert out.with_suffix(".png").stat().st_size > 1000
    text = capsys.readouterr().out
    assert "eagle-chain" in text and "lossless eagle-chain: held" in text and "left-truncated" in text


def test_bench_tree_sampled(tiny, prompts):
    target, drafter = tiny
    cfg = BenchConfig(prompts=prompts, method="tree", top_k=3, depth=3, total_tokens=8, temperature=0.8,
                      max_new_tokens=8, max_seq=160, limit=2)
    rep = run_bench(cfg, target=target, drafter=drafter)
    assert "lossless" not in rep and rep["records"] == 2
    assert len(rep["methods"]["eagle-tree"]["acceptance_by_position"]) == 3


def test_bench_refuses_bad_input(tiny, prompts, tmp_path):
    target, drafter = tiny
    with pytest.raises(EyasError, match="target"):
        other = dict(target.fingerprint, config_sha256="0" * 64)
        run_bench(BenchConfig(prompts=prompts, max_seq=160, max_new_tokens=4), target=target, drafter=drafter,
                  drafter_meta={"target": other, "source": "somewhere"})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EyasError, match="no prompts"):
        run_bench(BenchConfig(prompts=str(empty), max_seq=160), target=target, drafter=drafter)
    with pytest.raises(EyasError):
        BenchConfig(temperature=-1)
    with pytest.raises(EyasError):
        run_bench(BenchConfig(prompts=prompts, method="tree", total_tokens=200, max_seq=160, max_new_tokens=4),
                  target=target, drafter=drafter)


def test_cli_parses_into_config():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    register(sub)
    a = ap.parse_args(["bench", "--drafter", "RUN", "--prompts", "humaneval", "--tree", "--temperature", "0.5",
                       "--limit", "7", "--json", "o.json"])
    assert a.tree and a.chain is None and a.limit == 7 and a.json_out == "o.json" and callable(a.func)
    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "--chain", "3", "--tree"])
