"""The served check (engines/served_check.py) on the tiny DeepSeek-V3 twin, with the target only served.

The server is the SGLang-shaped DeepSeek-V3 of tests/test_engine_deepseek.py on the twin's real weights, with the
--forward-hooks of `eyas engine launch-args` for SGLang 0.5.14 (capture hook + aux enable hook, which installs the
probe switch) or 0.5.23 (capture hook + probe switch hook; the server sets its aux layers itself and packs the aux
states (N, K*h)), run by root.forward() one request per /generate, answering greedy output_ids. The check reads only
a weightless copy of the twin (config, index and the head shards). It must pass on a correct capture, and fail on:
a server launched with aux ids one layer off (either way, naming the layer), a final slot captured before the
final norm, and a capture placed after the layer instead of before it (the seed's wrong-method bug: only the
probe's anchor sees it, since store and probe are shifted alike).
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn

from support.deepseek_twin import make_twin, save_twin, weightless_copy
from eyas.cli import main
from eyas.engines.capture import run_engine_capture
from eyas.engines.client import EngineCaptureConfig
from eyas.engines.launch_args import hook_spec
from eyas.engines.served_check import (CHECK_FILE, PROBE_DIR, PROBE_RID, CheckConfig, probe_rid, report,
                                       run_served_check)
from eyas.engines.sglang_hook import CaptureHook, make_probe_switch_hook
from eyas.store.reader import Store
from test_engine_deepseek import DeepseekV2Model, DeepseekV3ForCausalLM, ForwardBatch, ForwardMode, LogitsProcessor, \
    batch
from test_engine_probe import http_engine
from test_engine_sglang_forward import register

g = torch.Generator().manual_seed(3)
SAMPLES = {f"s{i}": torch.randint(3, 320, (10 + 3 * i,), generator=g).tolist() for i in range(5)}
MASKS = {k: [1] * len(v) for k, v in SAMPLES.items()}
PREP = ({"target": {"identity": "twin", "config_sha256": "0", "tokenizer_sha256": "0"}}, SAMPLES, MASKS)
AUX = [2, 3, 4]           # the twin's default ids (7 layers)


class CaptureAfterLayer(DeepseekV2Model):
    """The seed's bug: layer i's capture placed after the layer ran (its output, HF id i + 1)."""

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        stream = self.embed_tokens(input_ids) if input_embeds is None else input_embeds   # (N, h)
        aux = []
        for i in range(len(self.layers)):
            stream = self._layer(i, stream, forward_batch)
            if i in self.layers_to_capture:
                aux.append(stream.clone())
        hidden = self.norm(stream)
        return (hidden, aux) if aux else hidden


class NormInLogits(nn.Module):
    """A logits processor handed the pre-norm stream (the final norm moved into it): greedy tokens unchanged,
    but the capture hook sees the state before the norm."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        return lm_head(self.norm(hidden_states))


class CountingLogitsProcessor(LogitsProcessor):
    """0.5.23 under --return-aux-hidden-state-layer-ids (logits_processor.py _check_aux_hidden_states): at its first
    forward with tokens the aux count must be the launch's, else ValueError (the scheduler dies); never again."""

    def __init__(self, expected: int):
        super().__init__()
        self.expected, self.checked = expected, False

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        if not self.checked and hidden_states.shape[0]:
            aux = aux_hidden_states
            got = 0 if aux is None else aux.shape[-1] / hidden_states.shape[-1] if torch.is_tensor(aux) else len(aux)
            if got != self.expected:
                raise ValueError(f"The model captured {got:g} aux hidden states, expected {self.expected}")
            self.checked = True
        return super().forward(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)


class Engine:
    """SGLang 0.5.14 (or 0.5.23) serving the twin: one forward per request (a probe can be batched with another
    user's). probe_hook=False drops launch-args' inner-model hook from a 0.5.23 launch."""

    def __init__(self, store, hf, *, server_ids=AUX, variant="ok", crowd_probes=0, launch="0.5.14", probe_hook=True):
        self.root = DeepseekV3ForCausalLM(hf, packed=launch >= "0.5.23")
        if variant == "after":
            self.root.model = CaptureAfterLayer(hf.model, hf.config.first_k_dense_replace, packed=False)
        elif variant == "prenorm":
            self.root.logits_processor = NormInLogits(self.root.model.norm)
            self.root.model.norm = nn.Identity()
        if launch >= "0.5.23":
            self.root.logits_processor = CountingLogitsProcessor(len(server_ids))
        capture = CaptureHook(store=store, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (0, 0, 1),
                              idle_flush_s=0.2)
        spec = hook_spec(str(store), "unused", list(server_ids), num_layers=7, aux_flag=launch >= "0.5.23")
        register(self.root, spec if probe_hook else spec[:1], capture)
        if launch >= "0.5.23":                           # --return-aux-hidden-state-layer-ids (DeepSeek: as given)
            self.root.set_eagle3_layers_to_capture(list(server_ids))
        self.lock, self.crowd_probes, self.probes = threading.Lock(), crowd_probes, 0
        self.forward({"warmup": [1, 2, 3]})

    def forward(self, reqs: dict) -> torch.Tensor:
        fb = batch(reqs)
        with torch.no_grad():
            return self.root.forward(fb.input_ids, fb.positions, fb)      # (N, V)

    def post(self, url, body, timeout):
        assert url.endswith("/generate"), url
        with self.lock:                                  # the scheduler runs one forward at a time
            rid, ids = body["rid"], body["input_ids"]
            reqs = {rid: ids}
            if rid.startswith(PROBE_RID):
                self.probes += 1
                if self.crowd_probes:                    # another user's request lands in the same batch
                    self.crowd_probes -= 1
                    reqs["someone-else"] = [7, 8, 9]
            logits = self.forward(reqs)
        return {"text": "x", "output_ids": [int(logits[len(ids) - 1].argmax())], "meta_info": {"id": rid}}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


@pytest.fixture(scope="module")
def twin():
    return make_twin()[0]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A weightless copy of the twin: config, tokenizer, index and the shards holding embed / norm / lm_head."""
    root = tmp_path_factory.mktemp("twin")
    return weightless_copy(save_twin(root / "full"), root / "weightless")


def capture(tmp_path, twin, **kw):
    out = tmp_path / "store"
    eng = Engine(out, twin, **kw)
    c = EngineCaptureConfig(engine="sglang", url="http://fake", data="fake", out=str(out), concurrency=1,
                            retries=1, commit_wait_s=10, hook_wait_s=2)
    m = run_engine_capture(c, aux_layer_ids=AUX, hidden_size=64, vocab_size=320, samples=PREP, post=eng.post)
    assert m["complete"]
    return out, eng


def check(out, head_dir, eng):
    res = run_served_check(CheckConfig(engine="sglang", url="http://fake", store=str(out), target=str(head_dir),
                                       wait_s=2), post=eng.post)
    print(report(res["rows"]))
    return {r["check"]: r for r in res["rows"]}, res


def test_a_correct_capture_passes_every_check(tmp_path, twin, head_dir):
    out, eng = capture(tmp_path, twin)
    rows, res = check(out, head_dir, eng)
    assert res["ok"], report(res["rows"])
    assert set(rows) == {"final slot post-norm", "final slot greedy", "probe anchor layer 0",
                         "aux slot 0 (HF id 2)", "aux slot 1 (HF id 3)", "aux slot 2 (HF id 4)"}
    assert rows["final slot greedy"]["value"].startswith("16/16 argmax")     # 4 samples x 4 cut points
    assert json.loads((out / CHECK_FILE).read_text())["ok"] is True
    assert sorted(Store(out).ids) == sorted(SAMPLES)                         # probes never reach the store
    assert len(list((out / PROBE_DIR).glob("*.pt"))) == 4


@pytest.mark.parametrize("shift", [1, -1])
def test_a_server_launched_one_layer_off_fails_naming_the_layer(tmp_path, twin, head_dir, shift):
    """The store says HF ids 2, 3, 4; the server captured 3, 4, 5 (or 1, 2, 3)."""
    out, eng = capture(tmp_path, twin, server_ids=[i + shift for i in AUX])
    rows, res = check(out, head_dir, eng)
    assert not res["ok"]
    for k, i in enumerate(AUX):
        r = rows[f"aux slot {k} (HF id {i})"]
        assert not r["ok"] and r["why"] == f"matches layer {i + shift} better: the store is one layer off"
    assert rows["probe anchor layer 0"]["ok"] and rows["final slot post-norm"]["ok"]   # the rest is right


def test_a_pre_norm_final_slot_fails(tmp_path, twin, head_dir):
    out, eng = capture(tmp_path, twin, variant="prenorm")
    rows, res = check(out, head_dir, eng)
    assert not res["ok"]
    assert not rows["final slot post-norm"]["ok"] and "pre-norm" in rows["final slot post-norm"]["why"]
    assert not rows["final slot greedy"]["ok"]
    assert all(rows[f"aux slot {k} (HF id {i})"]["ok"] for k, i in enumerate(AUX))


def test_a_capture_placed_after_the_layer_fails_the_anchor(tmp_path, twin, head_dir):
    """Store and probe both hold layer i's output: the neighbour comparison agrees, the anchor does not."""
    out, eng = capture(tmp_path, twin, variant="after")
    rows, res = check(out, head_dir, eng)
    assert not res["ok"] and not rows["probe anchor layer 0"]["ok"]
    assert "wrong place" in rows["probe anchor layer 0"]["why"]
    assert all(rows[f"aux slot {k} (HF id {i})"]["ok"] for k, i in enumerate(AUX))


def test_a_probe_batched_with_another_request_is_resent(tmp_path, twin, head_dir):
    out, eng = capture(tmp_path, twin, crowd_probes=2)
    _, res = check(out, head_dir, eng)
    assert res["ok"] and eng.probes == 4 + 2
    errs = [json.loads(p.read_text())["error"] for p in (out / PROBE_DIR).glob("*.json")]
    assert len(errs) == 2 and all(e.startswith("batched with other requests") for e in errs)
    assert sorted(Store(out).ids) == sorted(SAMPLES)


def prepared(root):
    from eyas.data.prepared import PreparedWriter, Sample
    w = PreparedWriter(root / "prep", identity={"test": 1})
    for sid, ids in SAMPLES.items():
        w.add(Sample(id=sid, input_ids=ids, loss_mask=MASKS[sid]))
    w.commit(len(SAMPLES), {})
    w.finish({"counts": {"kept": len(SAMPLES)}, "target": PREP[0]["target"]})
    return root / "prep"


def capture_cli(tmp_path, twin, target, *extra, **kw):
    out = tmp_path / "store"
    eng = Engine(out, twin, **kw)
    with http_engine(eng.post) as url:
        rc = main(["capture", "--engine", "sglang", "--url", url, "--data", str(prepared(tmp_path)), "--out", str(out),
                   "--target-config", str(target / "config.json"), "--hook-wait", "2", *extra])
        again = main(["engine", "check", "--engine", "sglang", "--url", url, "--store", str(out), "--target",
                      str(target), "-n", "2"])
    return rc, again, out, eng


def test_capture_engine_checks_by_default_and_the_command_agrees(tmp_path, twin, head_dir, capsys):
    """Over real HTTP: `eyas capture --engine` runs the check after the capture (one line per check, exit 0,
    STORE/check.json), and `eyas engine check` passes too."""
    rc, again, out, _ = capture_cli(tmp_path, twin, head_dir)
    text = capsys.readouterr().out
    assert rc == 0 and again == 0
    assert text.count("final slot greedy") == 2 and text.count("aux slot 2 (HF id 4)  ok") == 2
    assert json.loads((out / CHECK_FILE).read_text())["config"]["n"] == 2      # the command's run, last
    assert Store(out).manifest["complete"]


def test_a_capture_one_layer_off_exits_non_zero_and_keeps_its_store(tmp_path, twin, head_dir, capsys):
    rc, again, out, _ = capture_cli(tmp_path, twin, head_dir, server_ids=[3, 4, 5])
    text = capsys.readouterr().out
    assert rc == 1 and again == 1 and "matches layer 3 better: the store is one layer off" in text
    assert sorted(Store(out).ids) == sorted(SAMPLES)                 # the check never deletes captured data
    assert json.loads((out / CHECK_FILE).read_text())["ok"] is False


def test_a_target_without_head_tensors_stops_before_any_request(tmp_path, twin, capsys):
    """config.json alone: the check cannot run, so the capture refuses to start (or runs with --no-check)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(twin.config.to_dict()))
    out, prep = tmp_path / "store", prepared(tmp_path)
    eng = Engine(out, twin)
    sent = []
    with http_engine(lambda path, body, t: sent.append(body["rid"]) or eng.post(path, body, t)) as url:
        rc = main(["capture", "--engine", "sglang", "--url", url, "--data", str(prep), "--out",
                   str(out), "--target-config", str(bare / "config.json")])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "--no-check" in err and sent == []
        rc = main(["capture", "--engine", "sglang", "--url", url, "--data", str(prep), "--out",
                   str(out), "--target-config", str(bare / "config.json"), "--no-check", "--hook-wait", "2"])
    assert rc == 0 and not (out / CHECK_FILE).exists() and len(sent) == len(SAMPLES)


def capture_0_5_23(tmp_path, twin, **kw):
    out = tmp_path / "store"
    eng = Engine(out, twin, launch="0.5.23", **kw)
    c = EngineCaptureConfig(engine="sglang", url="http://fake", data="fake", out=str(out), concurrency=1,
                            retries=1, commit_wait_s=10, hook_wait_s=2)
    assert run_engine_capture(c, aux_layer_ids=AUX, hidden_size=64, vocab_size=320, samples=PREP,
                              post=eng.post)["complete"]
    return out, eng


@pytest.mark.parametrize("shift", [0, 1])
def test_sglang_0_5_23_probes_the_aux_slots(tmp_path, twin, head_dir, shift):
    """0.5.23 launch: the server sets its aux layers itself and the probe switch hook only swaps them for probe
    batches, so the aux slots are probed: pass on a correct store, fail one layer off naming the layer. The probes
    ask 6 layers (0-5) of a server launched for 3, packed (N, 6h), and the server's own list comes back untouched."""
    out, eng = capture_0_5_23(tmp_path, twin, server_ids=[i + shift for i in AUX])
    native = eng.root.model.layers_to_capture
    rows, res = check(out, head_dir, eng)
    assert eng.root.model.layers_to_capture is native and native == [i + shift for i in AUX]
    assert rows["probe anchor layer 0"]["ok"] and rows["final slot greedy"]["ok"] and "aux slots" not in rows
    probe = torch.load(next((out / PROBE_DIR).glob("*.pt")), weights_only=True)
    assert probe["layers"] == [0, 1, 2, 3, 4, 5] and probe["states"].shape[1:] == (6, 64)
    assert res["ok"] is (shift == 0)
    for k, i in enumerate(AUX):
        r = rows[f"aux slot {k} (HF id {i})"]
        assert r["ok"] is (shift == 0)
        assert shift == 0 or r["why"] == f"matches layer {i + shift} better: the store is one layer off"
    assert sorted(Store(out).ids) == sorted(SAMPLES)                         # probes never reach the store


def test_sglang_0_5_23_without_the_probe_switch_hook_skips_the_aux_slots(tmp_path, twin, head_dir):
    """A 0.5.23 server launched with the capture hook alone: no probe switch, so the aux slots are reported
    skipped (not passed, not failed); the final-slot checks still run."""
    out, eng = capture_0_5_23(tmp_path, twin, probe_hook=False)
    rows, res = check(out, head_dir, eng)
    assert res["ok"] and rows["aux slots"]["ok"] is None and "no eyas probe switch" in rows["aux slots"]["why"]
    assert "eyas_probe_switch from 0.5.23" in rows["aux slots"]["why"]
    assert rows["final slot greedy"]["ok"] and rows["final slot post-norm"]["ok"]


class Inner(nn.Module):
    """An inner model whose server set layers_to_capture (or not): records the layers each forward ran with."""

    def __init__(self, native):
        super().__init__()
        self.layers = nn.ModuleList([nn.Identity() for _ in range(4)])
        self.layers_to_capture, self.ran = native, []

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        self.ran.append(list(self.layers_to_capture))
        return input_ids


def test_the_probe_switch_hook_never_touches_the_servers_layers_outside_probe_batches(capsys):
    from eyas.engines import served_check
    idle = ForwardBatch(ForwardMode.IDLE, [], [], [], torch.zeros(0, dtype=torch.long), torch.zeros(0))
    native = [1, 2, 3]
    m = Inner(native)
    m.register_forward_hook(make_probe_switch_hook({}))

    def run(reqs):
        fb = batch(reqs) if reqs else idle
        m(fb.input_ids, fb.positions, fb)
        return m.ran[-1], list(served_check._ACTIVE)
    assert run({}) == (native, [])
    assert run({probe_rid([1, 2], 0): [5, 6]}) == (native, [])       # not installed at an idle forward
    assert run({"warmup": [5, 6]}) == (native, [])                   # installed at the first forward with requests
    assert run({probe_rid([1, 2], 1): [5, 6]}) == ([1, 2], [[1, 2]])
    assert m.layers_to_capture is native
    assert run({probe_rid([1, 2], 2): [5, 6], "other": [7]})[0] == native
    got, why = run({probe_rid([2, 4], 3): [5, 6]})
    assert got == native and why[0].startswith("layer 4 is past the model's 4 layers")
    assert m.layers_to_capture is native and native == [1, 2, 3]

    bare = Inner([])                                                 # the server captures nothing: no switch
    bare.register_forward_hook(make_probe_switch_hook({}))
    for reqs in ({"warmup": [5]}, {probe_rid([1, 2], 4): [5]}):
        fb = batch(reqs)
        bare(fb.input_ids, fb.positions, fb)
    assert bare.ran == [[], []] and bare.layers_to_capture == []
    assert "has no layers_to_capture set by the server" in capsys.readouterr().err


@pytest.mark.parametrize("normed", [True, False])
def test_vllm_final_slot_checks(tmp_path, twin, head_dir, normed):
    """vLLM: the final-slot checks over /v1/completions token_ids; a store whose last slot kept vLLM's pre-norm
    state fails both, the aux slots are not probed."""
    from eyas.store.writer import StoreWriter
    out = tmp_path / "store"
    hdr = {"target": PREP[0]["target"], "layers": {"aux": AUX}, "dtype": "bf16", "hidden_size": 64,
           "vocab_size": 320, "data": {"path": "x"}, "config": {"engine": "vllm"}}
    w = StoreWriter(out, header=hdr, rank=0, world_size=1)
    for sid, ids in list(SAMPLES.items())[:4]:
        with torch.no_grad():
            o = twin(torch.tensor([ids]), output_hidden_states=True)
        final = o.hidden_states[-1][0] if normed else twin.model.layers[-1](  # the stream before the final norm
            o.hidden_states[-2], position_ids=torch.arange(len(ids))[None],
            position_embeddings=twin.model.rotary_emb(o.hidden_states[-2], torch.arange(len(ids))[None]))[0]
        final = final[0] if final.dim() == 3 else final
        w.add_sample(sid, torch.tensor(ids), MASKS[sid], torch.stack([o.hidden_states[i][0] for i in AUX], 1), final)
    w.close()

    def vllm(url, body, timeout):
        assert url.endswith("/v1/completions") and body["return_token_ids"] and body["temperature"] == 0
        with torch.no_grad():
            tok = int(twin(torch.tensor([body["prompt"]])).logits[0, -1].argmax())
        return {"choices": [{"text": "x", "token_ids": [tok]}]}

    res = run_served_check(CheckConfig(engine="vllm", url="http://fake", store=str(out), target=str(head_dir)),
                           post=vllm)
    rows = {r["check"]: r for r in res["rows"]}
    print(report(res["rows"]))
    assert rows["aux slots"]["ok"] is None
    assert res["ok"] is normed and rows["final slot post-norm"]["ok"] is normed
    assert rows["final slot greedy"]["ok"] is normed
