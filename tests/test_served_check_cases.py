"""The served check (engines/served_check.py) and the SGLang hooks it relies on, in the cases its purpose names and
where a one-line change of the check went unnoticed before.

The server is the SGLang-shaped DeepSeek-V3 twin of tests/test_engine_check.py (one forward per /generate, the
hooks `eyas engine launch-args` prints), varied here: served through the Kimi-K2.5 wrapper (its language model is
called with input_ids=None), launched before 0.5.23 by a server that sets its own aux layers, running forward
batches without `extend_seq_lens_cpu`, answering in bf16 with ties, or with a final norm holding a zero weight.
Each case goes through `run_served_check`, the check's public entry, against a weightless target directory.
The capture one layer off and the pre-norm final slot of a plain DeepSeek-V3 are tests/test_engine_check.py's.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eyas.engines import served_check
from eyas.engines.capture import run_engine_capture
from eyas.engines.client import EngineCaptureConfig
from eyas.engines.launch_args import hook_spec
from eyas.engines.served_check import PROBE_DIR, PROBE_RID, CheckConfig, probe_rid, report, run_served_check
from eyas.engines.sglang_hook import CaptureHook, make_aux_enable_hook, make_probe_switch_hook
from eyas.store.reader import Store
from test_engine_check import (AUX, MASKS, PREP, SAMPLES, CountingLogitsProcessor, NormInLogits, head_dir,  # noqa: F401
                               twin)
from test_engine_deepseek import DeepseekV2Model, DeepseekV3ForCausalLM, ForwardBatch, ForwardMode, \
    KimiK25ForConditionalGeneration, batch
from test_engine_sglang_forward import register
from test_weightless import kimi_wrapped

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread

INDEX = "model.safetensors.index.json"


@dataclass
class BareForwardBatch:           # a ForwardBatch without extend_seq_lens_cpu / extend_prefix_lens_cpu
    forward_mode: ForwardMode
    rids: list
    input_ids: torch.Tensor       # (N,)
    positions: torch.Tensor       # (N,)
    can_run_tbo: bool = False


def bare_batch(reqs: dict) -> BareForwardBatch:
    """{rid: ids} of one request -> an EXTEND batch that carries no per-request lengths."""
    (rid, ids), = reqs.items()
    return BareForwardBatch(ForwardMode.EXTEND, [rid], torch.tensor(ids), torch.arange(len(ids)))


class OneRequestModel(DeepseekV2Model):
    """The layer loop over a batch that does not say its requests' lengths: the batch is one request."""

    def _layer(self, i, stream, fb):
        whole = ForwardBatch(fb.forward_mode, fb.rids, [stream.shape[0]], [0], fb.input_ids, fb.positions)
        return super()._layer(i, stream, whole)


def argmax(row: torch.Tensor) -> int:
    return int(row.argmax())


def last_max_in_bf16(row: torch.Tensor) -> int:
    """A server whose logits are bf16 and whose sampler breaks a tie towards the last token id."""
    r = row.bfloat16()
    return int(torch.nonzero(r == r.max()).max())


class Server:
    """SGLang serving the twin, one forward per request: `kimi` serves it through the Kimi-K2.5 wrapper;
    `own_layers` is a pre-0.5.23 server that set its aux layers itself (set_eagle3_layers_to_capture before the
    warm-up); `make_batch` builds each forward's batch; `answer` picks the reply token from the last logits row."""

    def __init__(self, store, hf, *, server_ids=AUX, launch="0.5.14", kimi=False, own_layers=False, variant="ok",
                 make_batch=batch, answer=argmax):
        packed = launch >= "0.5.23"
        self.root = (KimiK25ForConditionalGeneration if kimi else DeepseekV3ForCausalLM)(hf, packed=packed)
        lm = self.root.language_model if kimi else self.root
        if make_batch is bare_batch:
            lm.model = OneRequestModel(hf.model, hf.config.first_k_dense_replace, packed=packed)
        if variant == "prenorm":
            lm.logits_processor = NormInLogits(lm.model.norm)
            lm.model.norm = nn.Identity()
        if packed:
            lm.logits_processor = CountingLogitsProcessor(len(server_ids))
        capture = CaptureHook(store=store, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (0, 0, 1),
                              idle_flush_s=0.2)
        spec = hook_spec(str(store), "unused", list(server_ids), num_layers=7, aux_flag=packed,
                         lm_head="language_model.logits_processor" if kimi else "logits_processor")
        register(self.root, spec, capture)
        if packed or own_layers:
            self.root.set_eagle3_layers_to_capture(list(server_ids))
        self.inner = lm.model
        self.make_batch, self.answer = make_batch, answer
        self.lock, self.probes = threading.Lock(), 0
        self.forward({"warmup": [1, 2, 3]})

    def forward(self, reqs: dict) -> torch.Tensor:
        fb = self.make_batch(reqs)
        with torch.no_grad():
            return self.root.forward(fb.input_ids, fb.positions, fb)      # (N, V)

    def post(self, url, body, timeout):
        assert url.endswith("/generate"), url
        with self.lock:
            rid, ids = body["rid"], body["input_ids"]
            self.probes += rid.startswith(PROBE_RID)
            logits = self.forward({rid: ids})
        return {"text": "x", "output_ids": [self.answer(logits[len(ids) - 1])], "meta_info": {"id": rid}}


def capture(tmp_path, hf, **kw) -> tuple[Path, Server]:
    out = tmp_path / "store"
    srv = Server(out, hf, **kw)
    c = EngineCaptureConfig(engine="sglang", url="http://fake", data="fake", out=str(out), concurrency=1,
                            retries=1, commit_wait_s=10, hook_wait_s=2)
    assert run_engine_capture(c, aux_layer_ids=AUX, hidden_size=64, vocab_size=320, samples=PREP,
                              post=srv.post)["complete"]
    return out, srv


def check(out, target, srv) -> tuple[dict, dict]:
    res = run_served_check(CheckConfig(engine="sglang", url="http://fake", store=str(out), target=str(target),
                                       wait_s=2), post=srv.post)
    print(report(res["rows"]))
    return {r["check"]: r for r in res["rows"]}, res


def with_tensors(src: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of target directory `src` whose named tensors are replaced in their shards."""
    d = Path(shutil.copytree(src, out))
    wm = json.loads((d / INDEX).read_text())["weight_map"]
    for name, t in tensors.items():
        shard = d / wm[name]
        held = load_file(shard)
        held[name] = t.detach().clone().contiguous()
        save_file(held, shard)
    return d


AUX_ROWS = [f"aux slot {k} (HF id {i})" for k, i in enumerate(AUX)]


# ------------------------------------------------------------------ the wrapper model (input_ids=None)

@pytest.fixture(scope="module")
def kimi_dir(head_dir, tmp_path_factory):
    """The weightless twin laid out as Kimi-K2.5: wrapper config with text_config, language_model.* head names."""
    return kimi_wrapped(head_dir, tmp_path_factory.mktemp("kimi") / "weightless")


@pytest.mark.parametrize("launch", ["0.5.14", "0.5.23"])
def test_a_wrapper_model_passes_on_a_correct_capture(tmp_path, twin, kimi_dir, launch):
    """Kimi-K2.5: its language model gets input_ids=None, so the capture and the probes take the ids from the
    forward batch; the check reads the wrapper's directory and probes the aux slots with the layer-0 anchor."""
    out, srv = capture(tmp_path, twin, kimi=True, launch=launch)
    rows, res = check(out, kimi_dir, srv)
    assert res["ok"], report(res["rows"])
    assert set(rows) == {"final slot post-norm", "final slot greedy", "probe anchor layer 0", *AUX_ROWS}
    assert all(rows[k]["ok"] for k in rows)
    assert srv.probes == 4 and sorted(Store(out).ids) == sorted(SAMPLES)


@pytest.mark.parametrize("shift", [1, -1])
def test_a_wrapper_model_captured_one_layer_off_fails_naming_the_layer(tmp_path, twin, kimi_dir, shift):
    out, srv = capture(tmp_path, twin, kimi=True, server_ids=[i + shift for i in AUX])
    rows, res = check(out, kimi_dir, srv)
    assert not res["ok"]
    for k, i in enumerate(AUX):
        r = rows[f"aux slot {k} (HF id {i})"]
        assert not r["ok"] and r["why"] == f"matches layer {i + shift} better: the store is one layer off"
    assert rows["probe anchor layer 0"]["ok"] and rows["final slot post-norm"]["ok"]


def test_a_wrapper_model_with_a_pre_norm_final_slot_fails(tmp_path, twin, kimi_dir):
    out, srv = capture(tmp_path, twin, kimi=True, variant="prenorm")
    rows, res = check(out, kimi_dir, srv)
    assert not res["ok"]
    assert not rows["final slot post-norm"]["ok"] and "pre-norm" in rows["final slot post-norm"]["why"]
    assert all(rows[k]["ok"] for k in AUX_ROWS)


# ------------------------------------------------------------------ the final slot's two checks

def test_a_server_whose_answers_tie_in_bf16_passes_the_greedy_check(tmp_path, twin, head_dir):
    """Every LM-head row has a twin (rows 2j and 2j+1 equal), the server computes its logits in bf16 and breaks
    ties towards the last id: its answers are never the check's argmax (the first id), always a tie."""
    hf = copy.deepcopy(twin)
    with torch.no_grad():
        hf.lm_head.weight[1::2] = hf.lm_head.weight[0::2]
    target = with_tensors(head_dir, tmp_path / "paired", {"lm_head.weight": hf.lm_head.weight})
    out, srv = capture(tmp_path, hf, answer=last_max_in_bf16)
    rows, res = check(out, target, srv)
    agree, total, tied = map(int, re.match(r"(\d+)/(\d+) argmax, (\d+) within", rows["final slot greedy"]["value"])
                             .groups())
    assert total == 16 and agree + tied == total and tied >= total // 2        # the server does tie
    assert rows["final slot greedy"]["ok"] and res["ok"], report(res["rows"])


def test_a_final_norm_weight_with_a_zero_entry_passes_the_post_norm_check(tmp_path, twin, head_dir):
    """y = x / rms(x) * w is 0 where w is 0: that entry says nothing about the norm and must not give 0/0."""
    hf = copy.deepcopy(twin)
    with torch.no_grad():
        hf.model.norm.weight[5] = 0.0
    target = with_tensors(head_dir, tmp_path / "zero", {"model.norm.weight": hf.model.norm.weight})
    out, srv = capture(tmp_path, hf)
    rows, res = check(out, target, srv)
    assert float(Store(out).get(0).final[:, 5].abs().max()) == 0.0              # the stored entry is 0
    assert rows["final slot post-norm"]["ok"], rows["final slot post-norm"]
    assert res["ok"], report(res["rows"])


# ------------------------------------------------------------------ how the probes reach the store

def test_probes_of_batches_without_extend_lengths_carry_every_token(tmp_path, twin, head_dir):
    """A forward batch without extend_seq_lens_cpu holds one request: a probe is saved with all its tokens and
    the aux slots pass, as they do with the lengths."""
    out, srv = capture(tmp_path, twin, make_batch=bare_batch)
    rows, res = check(out, head_dir, srv)
    assert res["ok"], report(res["rows"])
    assert all(rows[k]["ok"] for k in ("probe anchor layer 0", *AUX_ROWS))
    for p in (out / PROBE_DIR).glob("*.pt"):
        probe = torch.load(p, weights_only=True)
        assert probe["ids"].shape[0] == probe["states"].shape[0] > 0
        assert probe["ids"].tolist() == next(v[:len(probe["ids"])] for v in SAMPLES.values()
                                             if v[:len(probe["ids"])] == probe["ids"].tolist())


def test_a_pre_0_5_23_server_with_its_own_aux_layers_is_probed(tmp_path, twin, head_dir):
    """A server launched before 0.5.23 that set layers_to_capture itself (the enable hook leaves its layers
    alone) still gets the probe switch: the aux slots are probed, not reported unchecked, and its list survives."""
    out, srv = capture(tmp_path, twin, own_layers=True)
    native = srv.inner.layers_to_capture
    rows, res = check(out, head_dir, srv)
    assert "aux slots" not in rows and all(rows[k]["ok"] for k in ("probe anchor layer 0", *AUX_ROWS))
    assert res["ok"] and srv.probes == 4
    assert srv.inner.layers_to_capture is native and native == AUX


def test_a_one_layer_off_store_of_a_server_with_its_own_layers_fails(tmp_path, twin, head_dir):
    out, srv = capture(tmp_path, twin, own_layers=True, server_ids=[i + 1 for i in AUX])
    rows, res = check(out, head_dir, srv)
    assert not res["ok"]
    assert all(rows[f"aux slot {k} (HF id {i})"]["why"] == f"matches layer {i + 1} better: the store is one layer "
               f"off" for k, i in enumerate(AUX))


# ------------------------------------------------------------------ the probe switch after a forward that raised

class Abort(BaseException):
    """Not an Exception (like KeyboardInterrupt): torch runs no always_call hook for it."""


class Inner(nn.Module):
    """An inner model holding the server's layers_to_capture; records the layers each forward ran with and raises
    `fail` once when given one."""

    def __init__(self, native):
        super().__init__()
        self.layers = nn.ModuleList([nn.Identity() for _ in range(4)])
        self.layers_to_capture, self.ran, self.fail = native, [], None

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        self.ran.append(list(self.layers_to_capture))
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        return input_ids


def run_batch(m: Inner, reqs: dict) -> list[int]:
    fb = batch(reqs)
    m(fb.input_ids, fb.positions, fb)
    return m.ran[-1]


@pytest.mark.parametrize("factory", [make_probe_switch_hook, make_aux_enable_hook], ids=["0.5.23", "0.5.14"])
@pytest.mark.parametrize("err", [RuntimeError("CUDA out of memory"), Abort()], ids=["exception", "abort"])
def test_a_probe_forward_that_raised_leaves_the_servers_layers(factory, err):
    """A probe forward that raised never reaches the hook after it: the server's list must be back at once (an
    Exception), or at the latest when the next forward starts (anything torch runs no always_call hook for), so
    the next real batch captures the server's layers, never the probe's."""
    native = [1, 2, 3]
    m = Inner(native)
    m.register_forward_hook(factory({"layers_to_capture": [9, 9, 9]} if factory is make_aux_enable_hook else {}))
    assert run_batch(m, {"warmup": [5, 6]}) == native                  # installs the switch
    assert run_batch(m, {probe_rid([2, 3], 0): [5, 6]}) == [2, 3]
    assert m.layers_to_capture is native
    m.fail = err
    with pytest.raises(type(err)):
        run_batch(m, {probe_rid([1, 2], 1): [5, 6]})
    assert m.ran[-1] == [1, 2]                                         # the raising forward ran switched
    if isinstance(err, Exception):
        assert m.layers_to_capture is native                           # put back when it raised
    assert run_batch(m, {"s0#a0": [5, 6, 7]}) == native
    assert m.layers_to_capture is native and native == [1, 2, 3] and served_check._ACTIVE == []
