"""The bf16 capability check that presets use on the CPU."""

from eyas.target.device import cpu_bf16_fast


def test_cpu_bf16_flags():
    assert cpu_bf16_fast("processor: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert cpu_bf16_fast("flags : fpu avx2 amx_bf16 amx_tile\n")
    assert not cpu_bf16_fast("flags : fpu sse2 avx2 avx512f avx512_vnni\n")
    assert isinstance(cpu_bf16_fast(), bool)


def test_auto_dtype_follows_the_device(monkeypatch):
    from eyas.recipes import resolve_dtype
    from eyas.target import device

    for fast, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(device, "cpu_bf16_fast", lambda fast=fast: fast)
        assert resolve_dtype("auto", "cpu") == want
        assert resolve_dtype("auto", "cuda") == "bf16" and resolve_dtype("fp16", "cpu") == "fp16"
