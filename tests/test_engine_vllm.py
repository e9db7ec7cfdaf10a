"""vLLM extract_hidden_states files -> eyas store, with each bad file caught."""

import pytest
import torch
from safetensors.torch import save_file

from engine_fakes import header, true_states
from eyas.engines.vllm_ingest import ingest_dir
from eyas.store.reader import Store
from eyas.store.writer import StoreWriter

SAMPLES = {"a": list(range(5, 17)), "b": list(range(40, 49)), "c": list(range(70, 80))}
MASKS = {k: [1] * len(v) for k, v in SAMPLES.items()}


def vllm_file(d, sid, ids=None, layers=4, dtype=torch.bfloat16, nan=False):
    ids = SAMPLES[sid] if ids is None else ids
    aux, final = true_states(ids)
    hs = torch.cat([aux, final[:, None]], dim=1)[:, :layers].to(dtype)     # (T, n_layers, H)
    if nan:
        hs[1, 0, 0] = float("nan")
    save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(ids, dtype=torch.int64)},
              str(d / f"{sid}.safetensors"))
    (d / f"{sid}.safetensors.lock").touch()


def test_ingest_verifies_and_never_writes_twice(tmp_path):
    src, out = tmp_path / "vllm", tmp_path / "store"
    src.mkdir()
    vllm_file(src, "a")
    vllm_file(src, "b", ids=SAMPLES["b"][:-2])                # truncated: token count differs
    vllm_file(src, "c", layers=3)                             # launched without the final layer id
    w = StoreWriter(out, header=header())
    written, rejected = ingest_dir(src, w, SAMPLES, MASKS)
    w.close()
    assert written == ["a"]
    reasons = {r.sample_id: r.reason for r in rejected}
    assert "token count" in reasons["b"] and "expected (T, 4, H)" in reasons["c"]
    st = Store(out, allow_incomplete=True)
    s = st.by_id("a", dtype=torch.float32)
    aux, final = true_states(SAMPLES["a"])
    assert torch.equal(s.aux, aux.bfloat16().float()) and torch.equal(s.final, final.bfloat16().float())
    # fix b and c, rerun: only they are written; a is not duplicated
    vllm_file(src, "b")
    vllm_file(src, "c")
    w = StoreWriter(out, header=header())
    written, rejected = ingest_dir(src, w, SAMPLES, MASKS)
    w.close()
    assert written == ["b", "c"] and rejected == []
    m = w.finalize(set(SAMPLES))
    assert m["complete"] and sorted(Store(out).ids) == ["a", "b", "c"]


@pytest.mark.parametrize("bad", ["ids", "nan", "missing"])
def test_bad_files_rejected(tmp_path, bad):
    src = tmp_path / "vllm"
    src.mkdir()
    if bad == "ids":
        vllm_file(src, "a", ids=[1] + SAMPLES["a"][1:])
    elif bad == "nan":
        vllm_file(src, "a", nan=True)
    w = StoreWriter(tmp_path / "store", header=header())
    written, rejected = ingest_dir(src, w, {"a": SAMPLES["a"]}, MASKS)
    w.close()
    assert written == [] and len(rejected) == 1
    assert {"ids": "token ids differ", "nan": "non-finite", "missing": "no file"}[bad] in rejected[0].reason
