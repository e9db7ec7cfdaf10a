"""The tiny Kimi-K2.5 twin (tests/support/kimi_twin.py) as eyas and SGLang 0.5.14 see it.

eyas: the nested text_config and the three `language_model.*` head tensors found through the index, the capture
server's flags (hooks on the wrapper's inner modules, --trust-remote-code for its processor), the drafter shape
(the same as for its language model alone). SGLang (from the 0.5.14 wheel, skipped without it): its own
KimiK25Config parses config.json; its KimiK25ForConditionalGeneration, built on the CPU with stand-ins for the
GPU layers, loads every vision and projector tensor of the checkpoint into a parameter of the same shape, fills
every such parameter, and hands its DeepSeek loader exactly the DeepSeek twin's tensor names.
"""

import ast
import fnmatch
import json
import re
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from support import engine_src
from support.deepseek_twin import TEMPLATE as DEEPSEEK_TEMPLATE
from support.deepseek_twin import save_twin
from support.kimi_twin import HEAD_TENSORS, MEDIA_PAD, PREFIX, save_kimi_twin
from eyas.cli import main
from eyas.model.drafter import DrafterConfig
from eyas.target.meta import open_target_meta

SGLANG = "0.5.14"


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return save_kimi_twin(tmp_path_factory.mktemp("kimi") / "twin")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return save_twin(tmp_path_factory.mktemp("deepseek") / "twin")


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())):
        with safe_open(str(d / f), framework="pt") as sf:
            out |= {k: sf.get_tensor(k) for k in sf.keys()}
    return out


def launch_args(capsys, target: Path) -> list[str]:
    assert main(["engine", "launch-args", "sglang", "--target-config", str(target / "config.json"),
                 "--version", SGLANG, "--model", str(target), "--store", "S", "--data", "P"]) == 0
    return capsys.readouterr().out.replace("\\\n", " ").split()


def test_meta_reads_the_text_config_and_the_language_model_heads(kimi):
    """The text config is text_config's (7 layers, h 64, untied); the head tensors are the language_model.* ones,
    found through the index, each in a shard of its own or with the other head, and read as stored."""
    t = open_target_meta(str(kimi))
    assert (t.config.num_hidden_layers, t.hidden_size, t.tie_word_embeddings, t.vocab_size) == (7, 64, False, 321)
    assert {k: h["name"] for k, h in t.heads.items()} == dict(zip(("embed", "norm", "lm_head"), HEAD_TENSORS))
    wm = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    for name in HEAD_TENSORS:
        assert all(not k.startswith(PREFIX + "model.layers.") for k, f in wm.items() if f == wm[name])
    stored = tensors(kimi)
    assert torch.equal(t.embed_tokens.weight, stored[HEAD_TENSORS[0]])
    assert torch.equal(t.final_norm.weight, stored[HEAD_TENSORS[1]])
    assert torch.equal(t.lm_head.weight, stored[HEAD_TENSORS[2]])


def test_language_model_is_the_deepseek_twin(kimi, deepseek):
    """Every language_model.X is the DeepSeek twin's X bit for bit (embedding and head: plus the image token's
    row), so states captured through the wrapper compare with the DeepSeek twin run in process."""
    k, d = tensors(kimi), tensors(deepseek)
    lm = {n.removeprefix(PREFIX): w for n, w in k.items() if n.startswith(PREFIX)}
    assert set(lm) == set(d)
    for n, w in d.items():
        got = lm[n][: w.shape[0]] if n in ("model.embed_tokens.weight", "lm_head.weight") else lm[n]
        assert torch.equal(got, w), n
    assert lm["lm_head.weight"].shape[0] == d["lm_head.weight"].shape[0] + 1


def test_capture_server_flags(capsys, kimi):
    """--trust-remote-code (the processor is remote code); the capture hook on the wrapper's LogitsProcessor and
    the enable hook on its language model's decoder; the aux ids in DeepSeek's SGLang convention."""
    out = launch_args(capsys, kimi)
    assert "--trust-remote-code" in out
    spec = json.loads(out[out.index("--forward-hooks") + 1].strip("'"))
    assert [(h["name"], h["target_modules"]) for h in spec] == [
        ("eyas_capture", ["language_model.logits_processor"]), ("eyas_enable_aux", ["language_model.model"])]
    assert spec[0]["config"]["aux_layer_ids"] == spec[1]["config"]["layers_to_capture"] == [2, 3, 4]
    assert spec[0]["config"]["num_layers"] == 7


def test_remote_processor_needs_trust_remote_code(capsys, tmp_path, deepseek):
    """A target whose config and tokenizer need no code but whose processor does (processor_config.json's
    auto_map, as the Kimi twin's and Kimi-K2.5's): SGLang loads that processor at start-up for a multimodal
    architecture, so launch-args must add --trust-remote-code."""
    d = tmp_path / "t"
    d.mkdir()
    for f in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (d / f).write_bytes((deepseek / f).read_bytes())
    assert "--trust-remote-code" not in launch_args(capsys, d)
    (d / "processor_config.json").write_text(json.dumps({"auto_map": {"AutoProcessor": "p.P"}}))
    assert "--trust-remote-code" in launch_args(capsys, d)


def test_drafter_shape_is_the_language_models(kimi, deepseek):
    """The wrapper gives the drafter of its language model (vocabulary: one more, the image token)."""
    k, d = open_target_meta(str(kimi)), open_target_meta(str(deepseek))
    ck = DrafterConfig.from_target(k.config, draft_vocab_size=64, aux_layer_ids=k.aux_layer_ids)
    cd = DrafterConfig.from_target(d.config, draft_vocab_size=64, aux_layer_ids=d.aux_layer_ids)
    assert ck.vocab_size == cd.vocab_size + 1 == 321
    assert {**vars(ck), "vocab_size": 0} == {**vars(cd), "vocab_size": 0}


def test_processor_and_template(kimi, deepseek):
    """AutoProcessor loads the twin's processor only with trust_remote_code; the image token is the config's
    placeholder id; string conversations render and tokenize as with the DeepSeek twin (so their prepared data
    is the same), image parts render as the placeholder; SGLang's warm-up image (32x32) makes 4 tokens, a 4x4
    patch grid: the position grid's size, so no interpolation."""
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer

    p = AutoProcessor.from_pretrained(str(kimi), trust_remote_code=True)
    cfg = json.loads((kimi / "config.json").read_text())
    assert p.tokenizer.convert_tokens_to_ids(MEDIA_PAD) == cfg["media_placeholder_token_id"] == 320
    conv = [{"role": "user", "content": "Paris is the capital of France."}, {"role": "assistant", "content": "42"}]
    dtok = AutoTokenizer.from_pretrained(str(deepseek))
    assert dtok.chat_template == DEEPSEEK_TEMPLATE
    assert p.tokenizer.apply_chat_template(conv, tokenize=False) == dtok.apply_chat_template(conv, tokenize=False)
    text = p.tokenizer.apply_chat_template(conv, tokenize=False)
    assert p(text=[text])["input_ids"] == dtok([text])["input_ids"]
    img = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    assert MEDIA_PAD + "Describe the image." in p.tokenizer.apply_chat_template(img, tokenize=False)
    assert p.media_processor.media_tokens_calculator({"type": "image", "image": Image.new("RGB", (32, 32))}) == 4
    v = cfg["vision_config"]
    assert (v["init_pos_emb_height"], v["init_pos_emb_width"]) == (4, 4)
    with pytest.raises((ValueError, OSError)):   # 5.8.1: remote code refused; 5.24: its Kimi processor, no files
        AutoProcessor.from_pretrained(str(kimi))


# ------------------------------------------------------------ SGLang 0.5.14's own classes, on the CPU ----

def sglang_wheel() -> Path:
    found = sorted(engine_src.cache_dir().glob(f"sglang-{SGLANG}-*.whl"))
    if not found:
        pytest.skip(f"no SGLang {SGLANG} wheel in {engine_src.cache_dir()}")
    return found[0]


def wheel_module(whl: Path, member: str, name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = member
    with zipfile.ZipFile(whl) as z:
        exec(compile(z.read(member).decode(), member, "exec"), mod.__dict__)  # noqa: S102 (test: a wheel's source)
    return mod


def test_processor_has_what_sglang_reads(kimi):
    """Every media_proc_cfg key SGLang's Kimi processor reads at start-up, and the attributes it takes."""
    with zipfile.ZipFile(sglang_wheel()) as z:
        src = z.read("sglang/srt/multimodal/processors/kimi_k25.py").decode()
    from transformers import AutoProcessor

    p = AutoProcessor.from_pretrained(str(kimi), trust_remote_code=True)
    keys = set(re.findall(r'media_proc_cfg\["(\w+)"\]', src))
    assert keys and keys <= set(p.media_processor.media_proc_cfg)
    for attr in set(re.findall(r"hf_processor\.(\w+)", src)) - {"media_processor"}:
        assert hasattr(p, attr), attr
    # SGLang's own resize math on its warm-up image (32x32): 4 tokens from a 4x4 patch grid, the twin's
    # position grid, so its vision tower runs without interpolating positions.
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize_config")
    ns: dict = {"math": __import__("math")}
    exec(compile(ast.Module([fn], []), "kimi_k25.py", "exec"), ns)  # noqa: S102 (test: a wheel's function)
    c = p.media_processor.media_proc_cfg
    r = ns["navit_resize_config"](32, 32, c["patch_size"], c["merge_kernel_size"], c["in_patch_limit"],
                                  c["patch_limit_on_one_side"])
    grid = tuple((r[f"new_{k}"] + r[f"pad_{k}"]) // c["patch_size"] for k in ("height", "width"))
    assert r["num_tokens"] == 4 and grid == (4, 4)
    v = json.loads((kimi / "config.json").read_text())["vision_config"]
    assert grid == (v["init_pos_emb_height"], v["init_pos_emb_width"])


def test_sglang_config_parses(kimi, deepseek):
    """SGLang's KimiK25Config (as HfModelConfigParser builds it): its text config is the DeepSeek twin's config as
    SGLang reads that twin (AutoConfig) but for the vocabulary, so the language model SGLang builds is the one it
    served live; the vision keys its vision tower and projector read."""
    from transformers import AutoConfig

    cfg = wheel_module(sglang_wheel(), "sglang/srt/configs/kimi_k25.py", "sglang_kimi_cfg").KimiK25Config
    c = cfg.from_pretrained(str(kimi))
    t, v = c.text_config, c.vision_config
    skip = ("vocab_size", "_name_or_path")
    ref = {k: x for k, x in AutoConfig.from_pretrained(str(deepseek)).to_dict().items() if k not in skip}
    assert {k: x for k, x in t.to_dict().items() if k not in skip} == ref
    assert (type(t).__name__, t.vocab_size, t.num_hidden_layers, t.kv_lora_rank) == ("DeepseekV3Config", 321, 7, 32)
    assert (t.topk_method, t.scoring_func, t.moe_layer_freq, t.tie_word_embeddings) == ("noaux_tc", "sigmoid", 1, False)
    assert (v.hidden_size, v.vt_hidden_size, v.text_hidden_size, c.hidden_size) == (64, 64, 64, 64)
    assert c.media_placeholder_token_id == 320


class Recorder:
    loaded: dict = {}


def default_weight_loader(param, w):   # sglang/srt/model_loader/weight_utils.py: shape-checked copy
    assert param.size() == w.size(), (param.size(), w.size())
    param.data.copy_(w)
    Recorder.loaded[id(param)] = Recorder.loaded.get(id(param), 0) + 1


class DeepseekV3ForCausalLM(nn.Module):   # records what the Kimi loader hands its language model
    def __init__(self, config, quant_config=None, prefix=""):
        super().__init__()
        self.model, self.lm_head, self.logits_processor = nn.Module(), nn.Module(), nn.Module()
        self.received: list[str] = []

    def load_weights(self, weights):
        self.received += [n for n, _ in weights]


class VisionAttention(nn.Module):         # layers/attention/vision.py at TP 1: qkv_proj (3p, e), proj (e, p)
    def __init__(self, embed_dim, num_heads, projection_size, qkv_bias=True, proj_bias=True, **_):
        super().__init__()
        self.qkv_proj = nn.Linear(embed_dim, 3 * projection_size, bias=qkv_bias)
        self.proj = nn.Linear(projection_size, embed_dim, bias=proj_bias)


class MLP2(nn.Module):                    # models/kimi_vl_moonvit.py, unquantized: fc0, fc1
    def __init__(self, dims, activation, bias=True, quant_config=None, prefix=""):
        super().__init__()
        self.fc0, self.fc1 = nn.Linear(dims[0], dims[1], bias=bias), nn.Linear(dims[1], dims[2], bias=bias)


class ReplicatedLinear(nn.Linear):        # layers/linear.py: weight (out, in), bias
    def __init__(self, input_size, output_size, bias=True, prefix="", **_):
        super().__init__(input_size, output_size, bias=bias)


class WeightsMapper:                      # models/utils.py, the prefix rule kimi_k25.py uses
    def __init__(self, orig_to_new_prefix):
        self.prefix = orig_to_new_prefix

    def apply(self, weights):
        for n, w in weights:
            yield next((new + n[len(old):] for old, new in self.prefix.items() if n.startswith(old)), n), w


def stand_ins(whl: Path) -> dict[str, types.ModuleType]:
    """sys.modules entries for what kimi_k25.py imports: the real config module, CPU stand-ins for the rest."""
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    empty = type("Empty", (), {})
    s = "sglang.srt."
    mods = [mod(s + "eplb.expert_location", ModelConfigForExpertLocation=empty),
            mod(s + "layers.conv", Conv2dLayer=nn.Conv2d),
            mod(s + "layers.quantization.base_config", QuantizationConfig=empty),
            mod(s + "managers.mm_utils", MultiModalityDataPaddingPatternMultimodalTokens=empty,
                general_mm_embed_routine=None),
            mod(s + "layers.attention.vision", VisionAttention=VisionAttention),
            mod(s + "layers.linear", ReplicatedLinear=ReplicatedLinear),
            mod(s + "layers.quantization.modelslim.modelslim", ModelSlimConfig=empty),
            mod(s + "layers.quantization.quark.quark", QuarkConfig=empty),
            mod(s + "managers.schedule_batch", Modality=types.SimpleNamespace(IMAGE="image"),
                MultimodalDataItem=empty, MultimodalInputs=empty),
            mod(s + "model_executor.forward_batch_info", ForwardBatch=empty, PPProxyTensors=empty),
            mod(s + "model_loader.weight_utils", default_weight_loader=default_weight_loader),
            mod(s + "models.deepseek_v2", DeepseekV3ForCausalLM=DeepseekV3ForCausalLM),
            mod(s + "models.kimi_vl_moonvit", MLP2=MLP2),
            mod(s + "models.utils", WeightsMapper=WeightsMapper),
            mod(s + "multimodal.mm_utils", run_dp_sharded_mrope_vision_model=None),
            mod(s + "server_args", get_global_server_args=lambda: types.SimpleNamespace(mm_enable_dp_encoder=False)),
            mod(s + "utils", add_prefix=lambda n, p: f"{p}.{n}" if p else n, is_npu=lambda: False),
            mod(s + "layers.dp_attention", is_dp_attention_enabled=lambda: False)]
    out = {m.__name__: m for m in mods}
    out[s + "configs.kimi_k25"] = wheel_module(whl, "sglang/srt/configs/kimi_k25.py", s + "configs.kimi_k25")
    return out


def test_sglang_kimi_loader_takes_every_tensor(kimi, deepseek, monkeypatch):
    """SGLang's KimiK25ForConditionalGeneration.load_weights on the checkpoint: each vision/projector tensor (real
    spelling: wqkv, wo, proj.0, proj.2) lands in a parameter of its shape (else ValueError / shape assert), every
    vision/projector parameter is filled once, and the language model receives the DeepSeek twin's names, the
    checkpoint SGLang 0.5.14 served live. The wrapper's modules that launch-args hooks each match one name."""
    whl = sglang_wheel()
    for name, m in stand_ins(whl).items():
        monkeypatch.setitem(sys.modules, name, m)
    kimi_mod = wheel_module(whl, "sglang/srt/models/kimi_k25.py", "sglang.srt.models.kimi_k25")
    cfg = sys.modules["sglang.srt.configs.kimi_k25"].KimiK25Config.from_pretrained(str(kimi))
    cfg.encoder_only = cfg.language_only = False        # model_config.py sets both on the hf config
    model = kimi_mod.KimiK25ForConditionalGeneration(cfg)
    Recorder.loaded = {}
    stored = tensors(kimi)
    model.load_weights(iter(stored.items()))
    vis = ("vision_tower.", "mm_projector.")
    vision = {n: p for n, p in model.named_parameters() if n.startswith(vis)}
    assert len(vision) == sum(n.startswith(vis) for n in stored) == 23
    assert {n: Recorder.loaded.get(id(p)) for n, p in vision.items()} == {n: 1 for n in vision}
    assert sorted(model.language_model.received) == sorted(tensors(deepseek))
    names = [n for n, _ in model.named_modules()]
    for pattern in ("language_model.logits_processor", "language_model.model"):
        assert [n for n in names if fnmatch.fnmatch(n, pattern)] == [pattern]


def test_sglang_renders_the_warmup_image_message(monkeypatch):
    """SGLang's own template reading (parser/jinja_template_utils.py): the twin's template takes content lists
    ('openai'), and the image message of SGLang's start-up warm-up renders with the placeholder its Kimi processor
    splits on."""
    import jinja2

    from support.kimi_twin import TEMPLATE

    monkeypatch.setitem(sys.modules, "sglang.srt.utils", types.SimpleNamespace(ImageData=dict))
    j = wheel_module(sglang_wheel(), "sglang/srt/parser/jinja_template_utils.py", "sglang_jinja_utils")
    assert j.detect_jinja_template_content_format(TEMPLATE) == "openai"
    warmup = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}},
                                          {"type": "text", "text": "Describe the image."}]}
    images: list = []
    msg = j.process_content_for_template_format(warmup, "openai", images, [], [], [])
    assert len(images) == 1
    text = jinja2.Template(TEMPLATE).render(messages=[msg], add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{MEDIA_PAD}Describe the image.<|im_end|>\n<|im_start|>assistant\n"


def test_wrapping_a_bf16_twin_keeps_its_dtype(tmp_path):
    """`kimi_twin.py OUT --from TWIN` (the device's path) around a bf16 twin: every tensor, vision included, and
    config.json's dtype are bf16, as SGLang's --dtype auto reads them; the language model is TWIN's."""
    from support.kimi_twin import wrap_twin

    twin = save_twin(tmp_path / "twin", layers=2, dtype=torch.bfloat16)
    k = wrap_twin(twin, tmp_path / "kimi")
    stored = tensors(k)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    cfg = json.loads((k / "config.json").read_text())
    assert cfg["dtype"] == cfg["text_config"]["dtype"] == "bfloat16"
    d = tensors(twin)
    assert all(torch.equal(stored[PREFIX + n][: w.shape[0]], w) for n, w in d.items())
