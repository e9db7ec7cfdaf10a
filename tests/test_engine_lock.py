"""One writer per store rank across engine capture, its SGLang hooks and in-process capture (store/lock.py)."""

import json
import os
import threading

import pytest

from support.engine_fakes import H, init_store, make_args
from eyas.cli import main
from eyas.engines.capture import run_engine_capture
from eyas.engines.client import EngineCaptureConfig
from eyas.engines.sglang_hook import CaptureHook, events_name
from eyas.errors import EyasError
from eyas.store.reader import Store
from test_stage_start import TARGET_LINE
from test_engine_client import MASKS, PREP, SAMPLES, FakeServer, cfg


def prepared(root):
    from eyas.data.prepared import PreparedWriter, Sample
    w = PreparedWriter(root / "prep", identity={"test": 1})
    for sid, ids in SAMPLES.items():
        w.add(Sample(id=sid, input_ids=ids, loss_mask=MASKS[sid]))
    w.commit(len(SAMPLES), {})
    w.finish({"counts": {"kept": len(SAMPLES)}})
    return root / "prep"


def target_config(root):
    p = root / "config.json"
    p.write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": H, "vocab_size": 1000}))
    return p


def test_a_second_capture_into_the_store_is_refused_naming_the_holder(tmp_path, capsys):
    """While an engine capture runs, `eyas capture --engine` and in-process `eyas capture` into the same directory
    exit 2 with one line naming it, before reading or sending anything; the first finishes complete."""
    out, prep, tc = tmp_path / "store", prepared(tmp_path), target_config(tmp_path)
    srv, second, once = FakeServer(out), {}, threading.Lock()

    def post(url, body, timeout):
        with once:
            if not second:    # in the middle of the first capture: its lock is held
                second["engine"] = main(["capture", "--engine", "sglang", "--url", "http://127.0.0.1:9", "--data",
                                         str(prep), "--out", str(out), "--target-config", str(tc)])
                second["engine_err"] = capsys.readouterr().err
                second["in_process"] = main(["capture", "--data", str(prep), "--out", str(out)])
                second["in_process_err"] = capsys.readouterr().err
        return srv.post(url, body, timeout)

    m = run_engine_capture(cfg(out), aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000, samples=PREP, post=post)
    for who in ("engine", "in_process"):
        err = second[f"{who}_err"]
        lines = [ln for ln in err.splitlines() if not TARGET_LINE.fullmatch(ln)]
        assert second[who] == 2 and len(lines) == 1, (who, err)
        assert f"is being written by pid {os.getpid()}" in err and "capture" in err
    assert m["complete"] and sorted(Store(out).ids) == sorted(SAMPLES)
    assert not list(out.glob(".lock-r*"))                 # every lock released (a killed run's is dropped anyway)
    calls = srv.calls                                     # afterwards the store is free: resumed, nothing to send
    m = run_engine_capture(cfg(out), aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000, samples=PREP,
                           post=srv.post)
    assert m["complete"] and srv.calls == calls


def hook(path):
    return CaptureHook(store=path, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (0, 0, 1), idle_flush_s=0)


def whole(rid):
    sid = rid.split("#")[0]
    return make_args([(rid, sid, 0, len(SAMPLES[sid]), 0)], SAMPLES)


def test_a_second_server_writing_the_same_rank_is_refused_until_the_first_flushes(tmp_path):
    init_store(tmp_path)
    a, b = hook(tmp_path), hook(tmp_path)                 # two servers launched with the same --store
    a(None, whole("s0#a0"))                               # a holds rank 1 until it flushes
    b(None, whole("s1#a0"))
    ev = [json.loads(x) for x in (tmp_path / events_name(0)).read_text().splitlines()]
    assert ev[0]["ok"] and not ev[1]["ok"]
    assert ev[1]["reason"].startswith("store locked") and f"pid {os.getpid()}" in ev[1]["reason"]
    a.flush()
    b(None, whole("s1#a1"))                               # the retry is written: the refusal wrote nothing
    b.flush()
    st = Store(tmp_path, allow_incomplete=True)
    assert sorted(st.ids) == ["s0", "s1"] and {r["rank"] for r in st.records} == {1}


def test_the_client_waits_for_a_hook_that_is_writing_then_refuses_naming_it(tmp_path):
    """The client's rank-0 writer cleans every rank's temp files, so it never runs while a hook writes."""
    out = tmp_path / "store"
    init_store(out)
    live = hook(out)
    live(None, whole("s0#a0"))                            # accepted, not yet flushed: rank 1 is held
    c = EngineCaptureConfig(engine="sglang", url="http://fake", data="fake", out=str(out), retries=0,
                            commit_wait_s=0.5)
    with pytest.raises(EyasError, match=r"rank 1 of this store is being written by pid .*still writing"):
        run_engine_capture(c, aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000, samples=PREP,
                           post=lambda *a: pytest.fail("nothing may be sent"))
    live.flush()
    assert Store(out, allow_incomplete=True).ids == ["s0"]   # the hook's sample survived the client's attempt
    srv = FakeServer(out)
    m = run_engine_capture(cfg(out), aux_layer_ids=[2, 4, 5], hidden_size=H, vocab_size=1000, samples=PREP,
                           post=srv.post)
    assert m["complete"] and "s0" not in srv.seen
