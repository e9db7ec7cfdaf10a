"""Every stage on a tiny random DeepSeek-V3 (tests/support/deepseek_twin.py: MLA, MoE with shared and routed experts after
first_k_dense_replace, YaRN RoPE, untied head), saved as a sharded HF directory and driven through the CLI as a user
would: prepare (regenerated locally by the twin) -> in-process capture -> offline and online training -> bench
(fp32, lossless) -> export. Each test states what its stage must have produced on this non-Llama target."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from support.deepseek_twin import CORPUS, save_twin
from eyas.cli import main

N_LAYERS = 7
AUX = [2, 3, 4]  # default_aux_layer_ids(7)
REPLY = 16       # regenerated reply length (the random twin never says eos that early)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The twin and every stage's output directory, made once through `eyas <stage>`."""
    root = tmp_path_factory.mktemp("deepseek-e2e")
    target = save_twin(root / "target")
    rng = random.Random(0)
    words = " ".join(CORPUS[:3]).split()

    def text(k):
        return " ".join(rng.choice(words) for _ in range(k))

    with open(root / "chats.jsonl", "w") as f:  # OpenAI-messages JSONL, two user turns each
        for i in range(16):
            msgs = [{"role": "user", "content": text(6)}, {"role": "assistant", "content": text(8)},
                    {"role": "user", "content": text(4)}, {"role": "assistant", "content": text(6)}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    with open(root / "bench.jsonl", "w") as f:
        for _ in range(2):
            f.write(json.dumps({"turns": [text(6), text(4)]}) + "\n")

    def eyas(*argv):
        assert main([str(a) for a in argv]) == 0, argv[0]

    eyas("prepare", "--target", target, "--data", root / "chats.jsonl", "--out", root / "prep", "--max-len", 128,
         "--heldout-fraction", 0.1, "--regenerate", "--max-new-tokens", REPLY, "--batch-size", 8, "--seed", 0)
    eyas("capture", "--target", target, "--data", root / "prep", "--out", root / "store", "--batch-tokens", 1024)
    train = ["--target", target, "--steps", 3, "--batch-tokens", 512, "--ttt-steps", 2, "--draft-vocab", 128,
             "--autocast", "off", "--deterministic", "--no-progress", "--eval-fraction", 0, "--lr", 1e-3]
    eyas("train", "--store", root / "store", "--out", root / "offline", *train)
    eyas("train", "--data", root / "prep", "--out", root / "online", *train)
    eyas("bench", "--target", target, "--drafter", root / "offline", "--prompts", root / "bench.jsonl", "--chain", 3,
         "--max-new-tokens", 12, "--device", "cpu", "--dtype", "fp32", "--max-seq", 256, "--json", root / "bench.json")
    eyas("export", "--drafter", root / "offline", "--out", root / "export", "--dtype", "fp32", "--target", target)
    return root


@pytest.fixture(scope="module")
def twin(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(run / "target", dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(run / "target"))


def samples(run):
    return [json.loads(line) for line in (run / "prep" / "samples.jsonl").read_text().splitlines()]


@torch.no_grad()
def greedy(model, ids, n):
    """Uncached argmax loop: the reference for the twin's own replies."""
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


def test_prepare_regenerated_every_reply_with_the_twin(run, twin):
    """Both assistant turns of each kept conversation are the twin's replies: the first reply's text is the
    twin's greedy continuation of the chat-templated prompt (decoded; prepare stores replies as text)."""
    model, tok = twin
    man = json.loads((run / "prep" / "manifest.json").read_text())
    got = samples(run)
    assert len(got) == man["counts"]["kept"] >= 12
    for s in got[:3]:
        ids, (start, end) = s["input_ids"], s["trainable"][0]
        reply = greedy(model, ids[:start], REPLY)
        assert tok.decode(ids[start:end - 1]) == tok.decode(reply, skip_special_tokens=True).strip()
        assert len(s["trainable"]) == 2  # the second turn was answered (and kept) too


def test_capture_stored_the_twins_aux_and_final_states(run, twin):
    """In-process capture on MLA/MoE layers: the store holds hidden_states[2, 3, 4] and the final-norm state of
    two samples (bf16 of the fp32 forward)."""
    from eyas.store.reader import Store

    model, _ = twin
    store = Store(run / "store", dtype=torch.float32)
    assert store.aux_layer_ids == tuple(AUX) and len(store) == len(samples(run))
    for i in (0, len(store) - 1):
        s = store[i]
        with torch.no_grad():
            hs = model(s.input_ids[None], output_hidden_states=True).hidden_states
        # bf16 storage of a padded batch's forward: within one bf16 step of this forward (neighbouring layers
        # differ by about 40% of the states' size)
        for slot, layer in enumerate(AUX):
            torch.testing.assert_close(s.aux[:, slot], hs[layer][0], rtol=2 ** -7, atol=1e-5, msg=f"layer {layer}")
        torch.testing.assert_close(s.final, hs[N_LAYERS][0], rtol=2 ** -7, atol=1e-5)


def test_offline_and_online_training_see_the_same_data(run):
    """Online training runs the twin inside each step (hooks on its MoE/MLA layers); offline reads the store:
    the same batches and positions, and losses equal up to the store's bf16 rounding."""
    def train_rows(d):
        return [json.loads(x) for x in (run / d / "metrics.jsonl").read_text().splitlines()
                if json.loads(x)["split"] == "train"]

    off, on = train_rows("offline"), train_rows("online")
    assert [r["step"] for r in off] == [r["step"] for r in on] == [1, 2, 3]
    for a, b in zip(off, on):
        assert a["positions_k"] == b["positions_k"]
        assert abs(a["loss"] - b["loss"]) < 1e-2 * abs(b["loss"])


def test_bench_decodes_the_twin_losslessly_in_fp32(run):
    """The bench decodes the DeepSeek-V3 target in process (the generic runner) and every speculative method's
    output equals plain greedy decoding token for token, prompt lookup with multi-token rounds among them."""
    rep = json.loads((run / "bench.json").read_text())
    assert rep["dtype"] == "fp32" and set(rep["methods"]) == {"plain", "lookup", "eagle-chain"}
    assert rep["turns"] == 4 and rep["methods"]["plain"]["tokens"] == 4 * 12
    for name in ("lookup", "eagle-chain"):
        assert rep["lossless"][name]["held"] and rep["lossless"][name]["turns"] == 4, name
    assert rep["methods"]["lookup"]["tau"] > 1  # accepted drafts: verified rows beyond the first were checked


def test_export_config_and_tensors(run):
    """config.json: a Llama EAGLE-3 head shaped as the trained drafter, aux ids in both engine conventions (HF ids
    for vLLM; SGLang's deepseek_v2 reading of eagle_config gives the same HF ids), the draft vocabulary; the
    tensors are the drafter's."""
    from eyas.target.layers import sglang_capture_ids

    cfg = json.loads((run / "export" / "config.json").read_text())
    drafter = json.loads((run / "offline" / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rope_theta", "rope_scaling", "vocab_size", "draft_vocab_size"):
        assert cfg[k] == drafter[k], k
    assert cfg["draft_vocab_size"] == 128 and cfg["vocab_size"] == 320 and not cfg["tie_word_embeddings"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == drafter["aux_layer_ids"] == AUX
    sglang = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang == [1, 2, 3] and sglang_capture_ids(sglang, "DeepseekV3ForCausalLM") == AUX
    assert cfg["eyas_target"]["config"]["model_type"] == "deepseek_v3"
    exported = load_file(run / "export" / "model.safetensors")
    trained = load_file(run / "offline" / "drafter" / "model.safetensors")
    assert exported["lm_head.weight"].shape == (128, cfg["hidden_size"])
    assert set(exported) <= set(trained) and "fc.weight" in exported
    for k, v in exported.items():
        assert torch.equal(v, trained[k]), k
