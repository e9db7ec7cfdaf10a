"""The --forward-hooks of `eyas engine launch-args` before SGLang 0.5.23, run the way SGLang runs them.

SGLang's runners call the model as `model.forward(...)`, not `model(...)`, so forward hooks on the root never
run; only submodules called as modules run theirs. Live on SGLang 0.5.14 the old enable hook sat on the root
(name ""): it never ran and the capture got no aux states. Here a torch model shaped like SGLang 0.5.14's
LlamaForCausalLM (llama.py: the inner `model` returns (hidden, aux) once `layers_to_capture` is set; the root
unpacks it only when its own `capture_aux_hidden_states` is on) gets the hooks registered as hook_manager does
(exact fnmatch over named_modules), is driven through `.forward()`, and must yield the true states of every
sample at the HF layer ids.
"""

import fnmatch
import importlib

import pytest
import torch
from torch import nn

from support.engine_fakes import ForwardMode, make_args, true_states
from eyas.engines.launch_args import hook_spec, inner_model_module
from eyas.engines.sglang_hook import CaptureHook
from test_engine_client import MASKS, SAMPLES

HF_IDS = [2, 4, 5]


class LlamaModel(nn.Module):
    """The decoder stack: aux states (the stream entering layer i) for each i in layers_to_capture."""

    def __init__(self):
        super().__init__()
        self.layers_to_capture: list[int] = []

    def forward(self, args):
        ids, final, _, fb, aux = args
        if not self.layers_to_capture:
            return final
        # make_args' aux slots hold the true states of HF_IDS; any other layer is garbage
        return final, [aux[HF_IDS.index(i)] if i in HF_IDS else torch.full_like(final, float("nan"))
                       for i in self.layers_to_capture]


class LogitsProcessor(nn.Module):
    def forward(self, input_ids, hidden, lm_head, forward_batch, aux=None):
        return hidden.sum()


class LlamaForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LlamaModel()
        self.logits_processor = LogitsProcessor()
        self.capture_aux_hidden_states = False

    def set_eagle3_layers_to_capture(self, ids):        # what an EAGLE-3 server calls (llama.py: +1)
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [i + 1 for i in ids]

    def forward(self, args):
        hidden = self.model(args)
        aux = None
        if self.capture_aux_hidden_states:
            hidden, aux = hidden
        return self.logits_processor(args[0], hidden, None, args[3], aux)


class KimiK25(nn.Module):
    """A multimodal wrapper: the language model in an attribute, called as a module."""

    def __init__(self):
        super().__init__()
        self.language_model = LlamaForCausalLM()

    def forward(self, args):
        return self.language_model(args)


class Writer:
    def __init__(self):
        self.samples = {}

    def add_sample(self, sid, ids, mask, aux, final):
        self.samples[sid] = (ids, aux, final)

    def close(self):
        pass


def register(model, spec, capture):
    """sglang/srt/model_executor/hook_manager.register_forward_hooks: fnmatch on named_modules; the capture
    factory's hook is built here with fixed ranks (no SGLang runtime), the enable factory is the real one."""
    names = dict(model.named_modules())
    for s in spec:
        if s["name"] == "eyas_capture":
            hook = capture
        else:
            mod, fn = s["hook_factory"].split(":")
            hook = getattr(importlib.import_module(mod), fn)(s["config"])
        matched = [m for n, m in names.items() if any(fnmatch.fnmatch(n, p) for p in s["target_modules"])]
        assert matched, f"No modules matched hook spec {s['name']!r} patterns={s['target_modules']}"
        for m in matched:
            m.register_forward_hook(hook)


def serve(tmp_path, model, lm_head, *, eagle3_server=False):
    writer = Writer()
    capture = CaptureHook(store=tmp_path, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (0, 0, 1),
                          writer_factory=lambda rank, world: writer, idle_flush_s=0)
    spec = hook_spec(str(tmp_path), "unused", HF_IDS, num_layers=6, aux_flag=False, lm_head=lm_head)
    register(model, spec, capture)
    if eagle3_server:                                    # the server itself switched capture on
        causal = model.get_submodule(lm_head.rsplit("logits_processor", 1)[0].rstrip(".") or "")
        causal.set_eagle3_layers_to_capture([i - 1 for i in HF_IDS])
    model.forward(make_args([("warmup", "s0", 0, 3, 0)], SAMPLES, mode=ForwardMode.DECODE))   # the warm-up
    for sid, ids in SAMPLES.items():
        model.forward(make_args([(f"{sid}#a0", sid, 0, len(ids), 0)], SAMPLES))
    return writer.samples


@pytest.mark.parametrize("make, lm_head", [(LlamaForCausalLM, "logits_processor"),
                                           (KimiK25, "language_model.logits_processor")])
def test_launch_args_hooks_capture_through_a_root_run_by_forward(tmp_path, make, lm_head):
    got = serve(tmp_path, make(), lm_head)
    assert sorted(got) == sorted(SAMPLES)
    for sid, ids in SAMPLES.items():
        aux, final = true_states(ids)
        g_ids, g_aux, g_final = got[sid]
        assert g_ids.tolist() == ids and torch.equal(g_aux, aux) and torch.equal(g_final, final)


def test_a_server_that_captures_by_itself_is_left_alone(tmp_path):
    """An EAGLE-3 server already set layers_to_capture: the aux states come through the logits processor."""
    got = serve(tmp_path, LlamaForCausalLM(), "logits_processor", eagle3_server=True)
    aux, _ = true_states(SAMPLES["s3"])
    assert sorted(got) == sorted(SAMPLES) and torch.equal(got["s3"][1], aux)


def test_the_enable_hook_targets_the_inner_model_not_the_root():
    assert inner_model_module("logits_processor") == "model"
    assert inner_model_module("language_model.logits_processor") == "language_model.model"
    spec = hook_spec("S", "D", HF_IDS, num_layers=6, aux_flag=False)
    assert spec[1]["target_modules"] == ["model"] and spec[1]["config"] == {"layers_to_capture": HF_IDS}
    spec = hook_spec("S", "D", HF_IDS, num_layers=6, aux_flag=True, lm_head="language_model.logits_processor")
    assert [(s["name"], s["target_modules"]) for s in spec] == [
        ("eyas_capture", ["language_model.logits_processor"]), ("eyas_probe_switch", ["language_model.model"])]
