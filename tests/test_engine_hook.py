"""SGLang hook against fake forward batches: chunking, prefix-cache hits, DP groups, TP duplicates."""

import json

import pytest
import torch

from support.engine_fakes import ForwardMode, init_store, make_args, true_states
from eyas.engines.sglang_hook import CaptureHook, events_name
from eyas.store.reader import Store

SAMPLES = {"s0": list(range(10, 22)), "s1": list(range(100, 107)), "s2": list(range(200, 215))}
MASKS = {k: [0] * 3 + [1] * (len(v) - 3) for k, v in SAMPLES.items()}


def hook(path, tp=0, dp=0, dp_size=1):
    return CaptureHook(store=path, expected=SAMPLES, loss_masks=MASKS, ranks=lambda: (tp, dp, dp_size),
                       idle_flush_s=0)


def events(path, rank=0):
    p = path / events_name(rank)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def check_sample(store, sid):
    s = store.by_id(sid, dtype=torch.float32)
    aux, final = true_states(SAMPLES[sid])
    assert s.input_ids.tolist() == SAMPLES[sid]
    assert torch.equal(s.aux, aux.bfloat16().float()) and torch.equal(s.final, final.bfloat16().float())
    assert s.loss_mask.tolist() == [bool(m) for m in MASKS[sid]]


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_prefill_segments_are_joined_in_order(tmp_path, packed):
    init_store(tmp_path)
    h = hook(tmp_path)
    # forward 1: s0 chunk [0,5) + s1 whole; forward 2: s0 [5,9) + s2 [0,6); forward 3: s0 [9,12) + s2 [6,15)
    h(None, make_args([("s0#a0", "s0", 0, 5, 0), ("s1#a0", "s1", 0, 7, 0)], SAMPLES, packed=packed))
    h(None, make_args([("s0#a0", "s0", 5, 9, 5), ("s2#a0", "s2", 0, 6, 0)], SAMPLES, packed=packed))
    h(None, make_args([("s0#a0", "s0", 9, 12, 9), ("s2#a0", "s2", 6, 15, 6)], SAMPLES, packed=packed))
    h.flush()
    from eyas.store.writer import StoreWriter
    StoreWriter(tmp_path, header=Store(tmp_path, allow_incomplete=True).manifest, rank=0, setup=False).finalize(set(SAMPLES))
    st = Store(tmp_path)
    assert sorted(st.ids) == ["s0", "s1", "s2"]
    for sid in SAMPLES:
        check_sample(st, sid)
    assert all(e["ok"] for e in events(tmp_path))


def test_prefix_cache_hit_is_rejected_and_reported(tmp_path):
    init_store(tmp_path)
    h = hook(tmp_path)
    # s1 arrives with 4 cached prefix tokens that were never computed in any forward we saw
    h(None, make_args([("s1#a0", "s1", 4, 7, 4), ("s0#a0", "s0", 0, 12, 0)], SAMPLES))
    h.flush()
    ev = {e["id"]: e for e in events(tmp_path)}
    assert ev["s1"]["ok"] is False and "prefix-cache hit" in ev["s1"]["reason"]
    assert ev["s0"]["ok"] is True
    assert Store(tmp_path, allow_incomplete=True).ids == ["s0"]


def test_out_of_order_chunk_rejected(tmp_path):
    init_store(tmp_path)
    h = hook(tmp_path)
    h(None, make_args([("s0#a0", "s0", 0, 5, 0)], SAMPLES))
    h(None, make_args([("s0#a0", "s0", 3, 12, 3)], SAMPLES))   # overlaps: starts at 3, 5 already seen
    ev = events(tmp_path)
    assert ev[-1]["ok"] is False and "out of order" in ev[-1]["reason"]


def test_tp_duplicates_write_nothing_and_dp_groups_write_their_own_shards(tmp_path):
    init_store(tmp_path, world_size=2)
    groups = {0: [("s0#a0", "s0", 0, 12, 0)], 1: [("s1#a0", "s1", 0, 7, 0), ("s2#a0", "s2", 0, 15, 0)]}
    for dp, segs in groups.items():
        for tp in range(4):                       # 4 attention-TP ranks per DP group see the same batch
            h = hook(tmp_path, tp=tp, dp=dp, dp_size=2)
            h(None, make_args(segs, SAMPLES))
            h.flush()
    st = Store(tmp_path, allow_incomplete=True)
    assert sorted(st.ids) == ["s0", "s1", "s2"]          # each once: TP ranks 1..3 wrote nothing
    ranks = {r["rank"]: r["ids"] for r in st.records}
    assert ranks == {1: ["s0"], 2: ["s1", "s2"]}         # DP group g is store rank g + 1 (0: the client)
    for sid in SAMPLES:
        check_sample(st, sid)


def test_ids_mismatch_nonfinite_missing_aux_and_padding_are_rejected(tmp_path):
    init_store(tmp_path)
    h = hook(tmp_path)
    args = make_args([("s0#a0", "s0", 0, 12, 0)], SAMPLES)
    args[0][5] = 999                                           # engine saw another token at position 5
    h(None, args)
    args = make_args([("s1#a0", "s1", 0, 7, 0)], SAMPLES)
    args[1][2, 3] = float("nan")
    h(None, args)
    h(None, make_args([("s2#a0", "s2", 0, 15, 0)], SAMPLES, drop_aux=True))
    args = make_args([("s0#a1", "s0", 0, 12, 0)], SAMPLES)
    padded = (torch.cat([args[0], torch.zeros(4, dtype=args[0].dtype)]),
              torch.cat([args[1], torch.zeros(4, args[1].shape[1])]), None, args[3],
              [torch.cat([a, torch.zeros(4, a.shape[1])]) for a in args[4]])   # CUDA-graph style padding
    h(None, padded)
    reasons = [e["reason"] for e in events(tmp_path)]
    assert "token ids differ" in reasons[0] and "position 5" in reasons[0]
    assert "non-finite" in reasons[1]
    assert "no aux hidden states" in reasons[2]
    assert "do not add up" in reasons[3]
    h.flush()
    assert Store(tmp_path, allow_incomplete=True).ids == []


def test_sample_never_written_twice(tmp_path):
    init_store(tmp_path)
    h = hook(tmp_path)
    h(None, make_args([("s0#a0", "s0", 0, 12, 0)], SAMPLES))
    h.flush()
    h(None, make_args([("s0#a1", "s0", 0, 12, 0)], SAMPLES))    # a retry arrives after success
    h.flush()
    h2 = hook(tmp_path)                                          # a restarted server sees the store
    h2(None, make_args([("s0#a2", "s0", 0, 12, 0)], SAMPLES))
    h2.flush()
    assert Store(tmp_path, allow_incomplete=True).ids == ["s0"]
    assert [e["ok"] for e in events(tmp_path)] == [True, False, False]


def test_decode_and_unknown_requests_are_ignored(tmp_path):
    init_store(tmp_path)
    h = hook(tmp_path)
    h(None, make_args([("s0#a0", "s0", 0, 1, 11)], SAMPLES, mode=ForwardMode.DECODE))
    h(None, make_args([("warmup", "s1", 0, 7, 0)], SAMPLES))
    assert events(tmp_path) == [] and h.asm.ignored == 1
