"""Client end to end against a fake SGLang server (the real hook inside): retries, rejections, resume."""

import threading

import torch

from support.engine_fakes import H, make_args
from eyas.engines.capture import run_engine_capture
from eyas.engines.client import EngineCaptureConfig
from eyas.engines.records import sample_id_of
from eyas.engines.sglang_hook import CaptureHook
from eyas.store.reader import Store

SAMPLES = {f"s{i}": list(range(10 * i + 1, 10 * i + 6 + i)) for i in range(8)}
MASKS = {k: [1] * len(v) for k, v in SAMPLES.items()}
PREP = ({"target": {"identity": "fake", "config_sha256": "0", "tokenizer_sha256": "0"}}, SAMPLES, MASKS)


class FakeServer:
    """POST /generate -> runs the hook on a batch with that request, split into 2 chunks."""

    def __init__(self, store, flaky=(), cached=(), die_after=None):
        self.hook = CaptureHook(store=store, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (0, 0, 1),
                                idle_flush_s=0.3)
        self.flaky, self.cached, self.die_after = set(flaky), set(cached), die_after
        self.seen, self.lock, self.calls = set(), threading.Lock(), 0

    def post(self, url, body, timeout):
        rid, sid = body["rid"], sample_id_of(body["rid"])
        with self.lock:
            self.calls += 1
            if self.die_after is not None and self.calls > self.die_after:
                raise ConnectionError("server gone")
            first = sid not in self.seen
            self.seen.add(sid)
            if first and sid in self.flaky:
                raise TimeoutError("read timeout")
            n = len(body["input_ids"])
            if first and sid in self.cached:      # radix cache hit of 2 tokens on the first attempt
                self.hook(None, make_args([(rid, sid, 2, n, 2)], SAMPLES))
            else:
                self.hook(None, make_args([(rid, sid, 0, 3, 0)], SAMPLES))
                self.hook(None, make_args([(rid, sid, 3, n, 3)], SAMPLES))
        return {"text": "x", "meta_info": {"id": rid}}


def cfg(out, **kw):
    return EngineCaptureConfig(engine="sglang", url="http://fake", data="fake", out=str(out), concurrency=4,
                               retries=2, commit_wait_s=10, **kw)


def test_retries_rejections_and_resume_give_each_sample_once(tmp_path):
    out = tmp_path / "store"
    srv = FakeServer(out, flaky={"s1", "s4"}, cached={"s2"}, die_after=5)
    m = run_engine_capture(cfg(out, ), aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000,
                           samples=PREP, post=srv.post)
    assert not m["complete"]                       # server died: incomplete, failures recorded
    assert (out / "engine-failures.jsonl").exists()
    srv2 = FakeServer(out, cached={"s2"})          # restarted server; client reruns
    before = set(Store(out, allow_incomplete=True).ids)
    m = run_engine_capture(cfg(out), aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000,
                           samples=PREP, post=srv2.post)
    assert m["complete"]
    st = Store(out)
    assert sorted(st.ids) == sorted(SAMPLES) and len(st.ids) == len(set(st.ids))
    assert not (before & srv2.seen)                # resume: committed samples were not sent again
    from support.engine_fakes import true_states
    for sid in SAMPLES:
        s = st.by_id(sid, dtype=torch.float32)
        assert torch.equal(s.aux, true_states(SAMPLES[sid])[0].bfloat16().float())
