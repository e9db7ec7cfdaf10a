"""The capture hook's target_modules name exactly one module: the target's LogitsProcessor.

SGLang's hook_manager registers a hook on every `model.named_modules()` entry whose name fnmatches a
target pattern, and only logs "No modules matched" otherwise. Kimi-K2.5 (the seed's target) keeps its
language model, and so its LogitsProcessor, under `language_model`.
"""

import fnmatch
import json

import pytest
from torch import nn

from support import engine_src
from support.engine_sglang_layouts import logits_processor_names, model_classes
from eyas.cli import main
from eyas.engines.launch_args import LM_HEAD_MODULES, lm_head_module, read_target_config


class LogitsProcessor(nn.Module):          # the class SGLang's causal LMs build as self.logits_processor
    pass


class DeepseekV3ForCausalLM(nn.Module):    # model / lm_head / logits_processor, as in deepseek_v2.py
    def __init__(self):
        super().__init__()
        self.model = nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(2, 2)]), "norm": nn.LayerNorm(2)})
        self.lm_head = nn.Linear(2, 3)
        self.logits_processor = LogitsProcessor()


class KimiK25ForConditionalGeneration(nn.Module):   # vision tower + projector + language model (kimi_k25.py)
    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Sequential(nn.Linear(2, 2))
        self.mm_projector = nn.Linear(2, 2)
        self.language_model = DeepseekV3ForCausalLM()


DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "hidden_size": 7168}
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {**DSV3, "model_type": "kimi_k2"}, "vision_config": {"hidden_size": 1152}}


def launch_targets(capsys, tmp_path, cfg, *extra) -> list[str]:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert main(["engine", "launch-args", "sglang", "--target-config", str(p), "--version", "0.5.23", *extra]) == 0
    out = capsys.readouterr().out.replace("\\\n", " ").split()
    spec = json.loads(out[out.index("--forward-hooks") + 1].strip("'"))
    return spec[0]["target_modules"]


def matched(model: nn.Module, patterns) -> list[tuple[str, nn.Module]]:
    """What hook_manager.register_forward_hooks would hook: fnmatch over named_modules() names."""
    return [(n, m) for n, m in model.named_modules() if any(fnmatch.fnmatch(n, p) for p in patterns)]


@pytest.mark.parametrize("cfg, model", [(KIMI_K25, KimiK25ForConditionalGeneration), (DSV3, DeepseekV3ForCausalLM)])
def test_hook_lands_on_the_one_logits_processor(capsys, tmp_path, cfg, model):
    hits = matched(model(), launch_targets(capsys, tmp_path, cfg))
    assert len(hits) == 1 and isinstance(hits[0][1], LogitsProcessor)


def test_unknown_wrapper_is_refused_and_override_is_used(capsys, tmp_path):
    other = {**KIMI_K25, "architectures": ["SomeVLForConditionalGeneration"]}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(other))
    assert main(["engine", "launch-args", "sglang", "--target-config", str(p)]) == 2
    assert "--lm-head-module" in capsys.readouterr().err
    assert launch_targets(capsys, tmp_path, other, "--lm-head-module", "lm.logits_processor") == ["lm.logits_processor"]


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_names_match_the_real_model_classes(version, tmp_path):
    whl = engine_src.wheel(version)
    if whl is None:
        pytest.skip(f"no SGLang {version} wheel cached and PyPI not reachable")
    classes = model_classes(whl)
    for arch in ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV2ForCausalLM",
                 "DeepseekV3ForCausalLM", *LM_HEAD_MODULES]:
        cfg = {"architectures": [arch], "num_hidden_layers": 4, "hidden_size": 8}
        if arch in LM_HEAD_MODULES:
            cfg = {"architectures": [arch], "text_config": cfg}
        p = tmp_path / f"{arch}.json"
        p.write_text(json.dumps(cfg))
        assert logits_processor_names(classes, arch) == [lm_head_module(read_target_config(p))], arch

