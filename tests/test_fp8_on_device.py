"""An fp8 store's batch crosses to the device as fp8 + scales (a byte a value on the host) and is dequantized
there: the batch equals one built from the reader's own dequantize, bit for bit, for bf16 and fp32 features."""

import pytest
import torch

from eyas.capture import CaptureConfig, run_capture
from eyas.store import Store
from eyas.train.data import StoreSource
from test_train import make_samples, tiny_target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_batch_dequantized_on_the_device_equals_the_readers(tmp_path, dtype):
    run_capture(CaptureConfig(out=str(tmp_path / "s"), dtype="fp8", progress=False), tiny_target(),
                samples=make_samples(12))
    store = Store(tmp_path / "s")
    src = StoreSource(store, max_len=64, feature_dtype=dtype)
    idx = [3, 0, 7, 11]
    host = src.collate(idx)
    assert host.aux.dtype == host.final.dtype == torch.float8_e4m3fn and host.scale.shape == (*host.valid.shape, 4)
    b = host.to("cpu")
    assert b.aux.dtype == b.final.dtype == dtype
    for r, i in enumerate(idx):
        s = store.get(i, dtype)
        n = s.final.shape[0]
        assert torch.equal(b.aux[r, :n], s.aux.reshape(n, -1)) and torch.equal(b.final[r, :n], s.final)
        assert not b.aux[r, n:].any() and not b.final[r, n:].any()      # padding: zeros, as before


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_collate_zeroes_the_padding_of_memory_it_did_not_zero(tmp_path, monkeypatch, kind):
    """collate fills uninitialised buffers: every row's states, then zeros after its length. Here torch.empty hands
    out buffers full of a nonzero pattern (fresh or recycled pages can hold anything); the batch must still be the
    reader's states and exact zeros on the padding, features and fp8 scales alike."""
    run_capture(CaptureConfig(out=str(tmp_path / "s"), dtype=kind, progress=False), tiny_target(),
                samples=make_samples(12))
    store = Store(tmp_path / "s")
    src = StoreSource(store, max_len=64, feature_dtype=torch.float32)
    empty = torch.empty

    def dirty(*shape, dtype=None, **kw):
        t = empty(*shape, dtype=dtype, **kw)
        return t.view(torch.uint8).fill_(0x3C).view(t.dtype) if t.numel() else t

    monkeypatch.setattr(torch, "empty", dirty)
    idx = [3, 0, 7, 11]
    host = src.collate(idx)
    monkeypatch.undo()
    assert host.valid.sum(1).tolist() != [host.valid.shape[1]] * len(idx)  # some rows padded
    if kind == "fp8":
        assert not (host.scale * ~host.valid[..., None]).any()
    b = host.to("cpu")
    for r, i in enumerate(idx):
        s = store.get(i, torch.float32)
        n = s.final.shape[0]
        assert torch.equal(b.aux[r, :n], s.aux.reshape(n, -1)) and torch.equal(b.final[r, :n], s.final)
        assert not b.aux[r, n:].any() and not b.final[r, n:].any()
