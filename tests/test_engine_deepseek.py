"""The SGLang capture hooks on DeepSeek-V3 and Kimi-K2.5, driven the way SGLang's own sources call the model.

Stand-ins shaped like SGLang's module tree (sglang 0.5.14 / 0.5.23 models/deepseek_v2.py, kimi_k25.py,
managers/mm_utils.py), running the tiny DeepSeek-V3 twin's real weights (tests/support/deepseek_twin.py):
  - DeepseekV2Model: the layer loop; layer i appends the stream entering it (`hidden_states + residual`) when
    i is in layers_to_capture; under two-batch overlap the layers from first_k_dense_replace on run through
    model_forward_stages, with no capture; returns (hidden, aux) only when something was captured.
  - DeepseekV3ForCausalLM: `self.model`, unpacks (hidden, aux) when capture_aux_hidden_states, then
    `self.logits_processor(input_ids, hidden, lm_head, forward_batch, aux)`.
  - KimiK25ForConditionalGeneration: `self.language_model` (a DeepseekV3ForCausalLM) called through
    general_mm_embed_routine as language_model(input_ids=None, forward_batch=..., input_embeds=embed(ids)), so
    the logits processor gets input_ids=None and the ids live only in forward_batch.input_ids.
The hooks are registered from the very `--forward-hooks` JSON `eyas engine launch-args` prints (hook_manager's
fnmatch over named_modules), the root is run by `.forward()` as SGLang's runner does, and the store must get each
sample's ids and the HF output_hidden_states at the aux ids, and the final-norm output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from support.deepseek_twin import make_twin
from support.engine_fakes import ForwardMode
from eyas.engines.launch_args import sglang_args
from eyas.engines.sglang_hook import CaptureHook
from test_engine_sglang_forward import Writer, register

PROMPTS = {"s0": [5, 17, 33, 2, 91, 64, 7, 250, 11], "s1": [40, 41, 42, 300, 12], "s2": list(range(60, 76))}
MASKS = {k: [1] * len(v) for k, v in PROMPTS.items()}


@dataclass
class ForwardBatch:                   # the ForwardBatch fields the model and the hook read
    forward_mode: ForwardMode
    rids: list
    extend_seq_lens_cpu: list
    extend_prefix_lens_cpu: list
    input_ids: torch.Tensor           # (N,) every token of the batch, requests packed in rid order
    positions: torch.Tensor           # (N,)
    can_run_tbo: bool = False


def batch(reqs: dict, *, tbo: bool = False) -> ForwardBatch:
    """{rid: ids} -> one EXTEND batch of whole prompts (no prefix), packed in order."""
    ids = [torch.tensor(v) for v in reqs.values()]
    return ForwardBatch(ForwardMode.EXTEND, list(reqs), [len(v) for v in ids], [0] * len(ids), torch.cat(ids),
                        torch.cat([torch.arange(len(v)) for v in ids]), tbo)


class DeepseekV2Model(nn.Module):
    """SGLang's decoder stack over the HF twin's embedding, layers and norm."""

    def __init__(self, hf_model, first_k_dense_replace: int, *, packed: bool):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = hf_model.embed_tokens, hf_model.layers, hf_model.norm
        self.rotary_emb = hf_model.rotary_emb
        self.first_k_dense_replace, self.packed = first_k_dense_replace, packed
        self.layers_to_capture: list[int] = []

    def _layer(self, i: int, stream: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Layer i on each request's rows (the attention backend's ragged batch): (N, h) -> (N, h)."""
        out, start = [], 0
        for n in fb.extend_seq_lens_cpu:
            x = stream[start:start + n][None]                                   # (1, n, h)
            pos = fb.positions[start:start + n][None]                           # (1, n)
            y = self.layers[i](x, attention_mask=None, position_ids=pos,
                               position_embeddings=self.rotary_emb(x, pos))
            out.append((y[0] if isinstance(y, tuple) else y)[0])                # (n, h)
            start += n
        return torch.cat(out)                                                   # (N, h)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        stream = self.embed_tokens(input_ids) if input_embeds is None else input_embeds   # (N, h)
        end = len(self.layers)
        normal_end = self.first_k_dense_replace if forward_batch.can_run_tbo else end
        aux = []
        for i in range(normal_end):
            if i in self.layers_to_capture:
                aux.append(stream.clone())              # hidden_states + residual entering layer i
            stream = self._layer(i, stream, forward_batch)
        for i in range(normal_end, end):                # model_forward_stages: two-batch overlap, no capture
            stream = self._layer(i, stream, forward_batch)
        hidden = self.norm(stream)
        if len(aux) == 0:
            return hidden
        return hidden, (torch.cat(aux, dim=-1) if self.packed else aux)   # 0.5.23 packs (N, K*h)


class LogitsProcessor(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        return lm_head(hidden_states)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, hf, *, packed: bool):
        super().__init__()
        self.config = hf.config
        self.model = DeepseekV2Model(hf.model, hf.config.first_k_dense_replace, packed=packed)
        self.lm_head = hf.lm_head
        self.logits_processor = LogitsProcessor()
        self.capture_aux_hidden_states = False

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_eagle3_layers_to_capture(self, layer_ids):          # deepseek_v2.py: +1 only when the first id is 1
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [v + 1 for v in layer_ids] if layer_ids[0] == 1 else list(layer_ids)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        hidden = self.model(input_ids, positions, forward_batch, input_embeds)
        aux = None
        if self.capture_aux_hidden_states:
            hidden, aux = hidden                                 # the unpack two-batch overlap breaks
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)


def general_mm_embed_routine(input_ids, forward_batch, language_model, **kwargs):
    """mm_utils.py, text-only: embed the ids, then call the language model with input_ids=None."""
    input_embeds = language_model.get_input_embeddings()(input_ids)
    return language_model(input_ids=None, forward_batch=forward_batch, input_embeds=input_embeds, **kwargs)


class KimiK25ForConditionalGeneration(nn.Module):
    def __init__(self, hf, *, packed: bool):
        super().__init__()
        self.language_model = DeepseekV3ForCausalLM(hf, packed=packed)

    def set_eagle3_layers_to_capture(self, layer_ids):
        self.language_model.set_eagle3_layers_to_capture(layer_ids)

    def forward(self, input_ids, positions, forward_batch):
        return general_mm_embed_routine(input_ids, forward_batch, self.language_model, positions=positions)


def target_config(hf, kimi: bool) -> dict:
    """config.json as the checkpoints write it: DeepSeek-V3 plain, Kimi-K2.5 wrapping it in text_config."""
    text = hf.config.to_dict() | {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    if not kimi:
        return text
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text, "vision_config": {"hidden_size": 32}}


@pytest.fixture(scope="module")
def twin():
    model, _ = make_twin()
    return model


def flag(args: list[str], name: str, k: int = 1) -> list[str]:
    i = args.index(name)
    return args[i + 1:i + 1 + k]


def serve(tmp_path, hf, *, kimi: bool, version: str, tbo: bool = False, then=()):
    """Build the SGLang-shaped model, register the hooks launch-args prints, run a warm-up, one batch of every
    prompt and the batches `then` ({rid: ids} each) through root.forward(), as SGLang's runner does
    -> {sample id: (ids, aux, final)}."""
    packed = version >= "0.5.23"
    tmp_path.mkdir(parents=True, exist_ok=True)
    root = (KimiK25ForConditionalGeneration if kimi else DeepseekV3ForCausalLM)(hf, packed=packed)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(target_config(hf, kimi)))
    args = sglang_args(str(cfg), version)
    spec = json.loads(flag(args, "--forward-hooks")[0])
    hf_ids = spec[0]["config"]["aux_layer_ids"]
    writer = Writer()
    capture = CaptureHook(store=tmp_path, expected=PROMPTS, loss_masks=MASKS, ranks=lambda: (0, 0, 1),
                          writer_factory=lambda rank, world: writer, idle_flush_s=0)
    register(root, spec, capture)
    if "--enable-return-aux-hidden-states" in args:       # 0.5.23: the server sets the ids itself
        root.set_eagle3_layers_to_capture([int(x) for x in flag(args, "--return-aux-hidden-state-layer-ids", 3)])
    with torch.no_grad():
        for fb in (batch({"warmup": [1, 2, 3]}, tbo=tbo),
                   batch({f"{sid}#a0": ids for sid, ids in PROMPTS.items()}, tbo=tbo),
                   *(batch(reqs, tbo=tbo) for reqs in then)):
            root.forward(fb.input_ids, fb.positions, fb)
    return writer.samples, hf_ids


def reference(hf, ids: list[int], hf_ids: list[int]):
    """HF output_hidden_states: (T, 3, h) at the aux ids, (T, h) final-norm output."""
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.stack([hs[i][0] for i in hf_ids], dim=1), hs[-1][0]


@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
@pytest.mark.parametrize("kimi", [False, True], ids=["deepseek_v3", "kimi_k25"])
def test_capture_through_sglang_shaped_deepseek_and_kimi(tmp_path, twin, kimi, version):
    got, hf_ids = serve(tmp_path, twin, kimi=kimi, version=version)
    assert hf_ids == [2, 3, 4] and sorted(got) == sorted(PROMPTS)
    for sid, ids in PROMPTS.items():
        g_ids, g_aux, g_final = got[sid]
        aux, final = reference(twin, ids, hf_ids)
        assert g_ids.tolist() == ids
        torch.testing.assert_close(g_aux, aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_final, final, rtol=1e-5, atol=1e-5)


def test_the_stand_in_is_not_vacuous(tmp_path, twin):
    """The captured aux states differ layer by layer (a store one layer off would not pass the test above)."""
    got, hf_ids = serve(tmp_path, twin, kimi=True, version="0.5.23")
    _, g_aux, _ = got["s2"]
    aux_off, _ = reference(twin, PROMPTS["s2"], [i + 1 for i in hf_ids])
    assert not torch.allclose(g_aux, aux_off, atol=1e-3)


@pytest.mark.parametrize("kimi", [False, True], ids=["deepseek_v3", "kimi_k25"])
def test_a_probe_on_a_0_5_23_launch_reaches_the_capture_hook_unpacked(tmp_path, twin, kimi):
    """The served check's probe on a 0.5.23 launch (the server's 3 layers set by itself, aux packed (N, K*h); Kimi:
    input_ids None at the logits processor): 5 layers arrive as (T, 5, h), each the HF stream entering that layer,
    and the capture is unchanged."""
    from eyas.engines.served_check import PROBE_DIR, probe_rid
    rid, ids = probe_rid([0, 1, 2, 3, 4], "x"), PROMPTS["s2"]
    got, hf_ids = serve(tmp_path, twin, kimi=kimi, version="0.5.23", then=[{rid: ids}])
    p = torch.load(tmp_path / PROBE_DIR / f"{rid}.pt", weights_only=True)
    with torch.no_grad():
        hs = twin(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert p["ids"].tolist() == ids and p["layers"] == [0, 1, 2, 3, 4] and p["states"].shape == (len(ids), 5, 64)
    torch.testing.assert_close(p["states"], torch.stack([hs[i][0] for i in range(5)], 1), rtol=1e-5, atol=1e-5)
    assert sorted(got) == sorted(PROMPTS)                       # the probe is never captured as a sample
    torch.testing.assert_close(got["s2"][1], torch.stack([hs[i][0] for i in hf_ids], 1), rtol=1e-5, atol=1e-5)


def test_the_0_5_23_sources_size_the_aux_states_from_the_switched_list_and_check_the_count_once():
    """What the probe on 0.5.23 relies on, read from the wheel: the root calls its inner model as a module (hooks
    run); the layer loop sizes its packer (DeepSeek) or list (Llama) from layers_to_capture at each forward; the
    logits processor checks the aux count only at its first forward with tokens, which the probe switch hook
    leaves to the server's own layers."""
    from support import engine_src
    whl = engine_src.wheel("0.5.23")
    if whl is None:
        pytest.skip("sglang 0.5.23 wheel not cached and PyPI unreachable")
    ds = engine_src.read_member(whl, "sglang/srt/models/deepseek_v2.py")
    fwd = ds.split("class DeepseekV2Model(", 1)[1].split("\n    def forward(", 1)[1].split("\nclass ", 1)[0]
    assert "aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))" in fwd
    assert "if i in self.layers_to_capture" in fwd and "return hidden_states, aux_hidden_states.finalize()" in fwd
    assert "hidden_states = self.model(\n" in ds.split("class DeepseekV2ForCausalLM(", 1)[1]
    llama = engine_src.read_member(whl, "sglang/srt/models/llama.py")
    assert "aux_hidden_states = AuxHiddenStateList()" in llama and "return hidden_states, aux_hidden_states" in llama
    lp = engine_src.read_member(whl, "sglang/srt/layers/logits_processor.py")
    check = lp.split("def _check_aux_hidden_states(", 1)[1].split("\n    def ", 1)[0]
    assert "self._aux_hidden_states_checked" in check and "forward_mode.is_idle()" in check
    assert "hidden_states.shape[0] == 0" in check and "self._aux_hidden_states_checked = True" in check


def test_no_ids_anywhere_rejects_each_request_instead_of_crashing_the_server(tmp_path):
    """input_ids None and a batch without input_ids: each request is rejected with the reason, none written."""
    from support.engine_fakes import make_args
    from eyas.engines.records import NO_IDS
    from test_engine_hook import SAMPLES, events
    from test_engine_hook import MASKS as HOOK_MASKS
    writer = Writer()
    h = CaptureHook(store=tmp_path, expected=SAMPLES, loss_masks=HOOK_MASKS, ranks=lambda: (0, 0, 1),
                    writer_factory=lambda rank, world: writer, idle_flush_s=0)
    _, final, head, fb, aux = make_args([("s0#a0", "s0", 0, 12, 0), ("s1#a0", "s1", 0, 7, 0)], SAMPLES)
    h(None, (None, final, head, fb, aux))
    assert writer.samples == {}
    assert [(e["id"], e["ok"], e["reason"]) for e in events(tmp_path)] == [("s0", False, NO_IDS), ("s1", False, NO_IDS)]


# ---- two-batch overlap ----

def test_two_batch_overlap_loses_the_aux_states_in_sglangs_layer_loop(tmp_path, twin):
    """Why it is refused: with can_run_tbo the aux layers (>= first_k_dense_replace) capture nothing, so 0.5.23's
    unpack of (hidden, aux) fails, and before it the hook sees no aux states."""
    with pytest.raises(ValueError):
        serve(tmp_path / "a", twin, kimi=True, version="0.5.23", tbo=True)
    got, _ = serve(tmp_path / "b", twin, kimi=True, version="0.5.14", tbo=True)
    assert got == {}


@pytest.fixture
def sglang_with_tbo(monkeypatch):
    """An SGLang whose scheduler ran initialize_moe_config with --enable-two-batch-overlap."""
    import types
    from eyas.engines.sglang_hook import MOE_UTILS
    flag = {"on": True}
    monkeypatch.setitem(__import__("sys").modules, MOE_UTILS,
                        types.SimpleNamespace(is_tbo_enabled=lambda: flag["on"]))
    return flag


def test_the_hooks_refuse_two_batch_overlap_when_they_load(tmp_path, sglang_with_tbo):
    from eyas.engines.sglang_hook import make_aux_enable_hook, make_capture_hook
    for make, cfg in ((make_capture_hook, {"store": str(tmp_path), "data": str(tmp_path / "none")}),
                      (make_aux_enable_hook, {"layers_to_capture": [2, 3, 4]})):
        with pytest.raises(RuntimeError) as e:
            make(cfg)
        msg = str(e.value)
        assert "\n" not in msg and "--enable-two-batch-overlap" in msg and "first_k_dense_replace" in msg
    sglang_with_tbo["on"] = False
    assert callable(make_aux_enable_hook({"layers_to_capture": [2, 3, 4]}))


@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
def test_is_tbo_enabled_is_set_before_the_hooks_load(version):
    """The accessor the hook reads exists in each wheel, is fed by --enable-two-batch-overlap, and the scheduler
    sets it (init_moe_gemm_config) before it builds the model worker, which loads the model and its hooks."""
    from support import engine_src
    whl = engine_src.wheel(version)
    if whl is None:
        pytest.skip(f"sglang {version} wheel not cached and PyPI unreachable")
    utils = engine_src.read_member(whl, "sglang/srt/layers/moe/utils.py")
    sched = engine_src.read_member(whl, "sglang/srt/managers/scheduler.py")
    assert "def is_tbo_enabled() -> bool:" in utils and "tbo_enabled = " in utils.lower()
    assert "enable_two_batch_overlap" in utils.split("def initialize_moe_config", 1)[1].split("\ndef ", 1)[0]
    assert sched.index("self.init_moe_gemm_config()") < sched.index("self.init_model_worker()")


@pytest.mark.parametrize("engine, info, flag", [
    ("sglang", {"enable_two_batch_overlap": True, "tp_size": 8}, "--enable-two-batch-overlap"),
    ("vllm", {"vllm_config": {"parallel_config": {"enable_dbo": True}}}, "--enable-dbo")])
def test_capture_refuses_a_server_reporting_batch_overlap_before_any_request(tmp_path, engine, info, flag):
    from eyas.engines.client import EngineCaptureConfig
    from eyas.engines.probe import Probe
    from eyas.errors import EyasError
    cfg = EngineCaptureConfig(engine=engine, url="http://srv", data="fake", out=str(tmp_path), vllm_dir=str(tmp_path),
                              target_config="config.json")
    asked, posted = [], []
    probe = Probe(cfg, tmp_path, get=lambda url, timeout: asked.append(url) or info)
    with pytest.raises(EyasError) as e:
        probe.send({"s0": [1, 2]}, attempt=0, post=lambda *a: posted.append(a))
    assert posted == [] and asked[0].startswith("http://srv/server_info")
    assert str(e.value).startswith(f"http://srv runs with {flag}: ") and "\n" not in str(e.value)


def test_a_server_without_overlap_or_without_server_info_is_probed_as_before(tmp_path):
    from eyas.engines.client import EngineCaptureConfig
    from eyas.engines.probe import Probe, refuse_overlap
    cfg = EngineCaptureConfig(engine="sglang", url="http://srv", data="fake", out=str(tmp_path))
    refuse_overlap(cfg, lambda url, timeout: {"enable_two_batch_overlap": False})

    def missing(url, timeout):
        raise OSError("404")
    refuse_overlap(cfg, missing)
    probe = Probe(cfg, tmp_path, get=missing)
    probe.verified = True                                  # the hook check itself is test_engine_probe's
    assert probe.send({"s0": [1, 2]}, attempt=0, post=lambda url, body, t: {"ok": url}) == \
        {"s0": {"ok": "http://srv/generate"}}
