"""The bf16 capability check that presets use on the CPU."""

import pytest

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


@pytest.mark.parametrize("cap, fast", [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", True),
                                       ("AVX512_CORE_AMX", True), ("ALL", True), ("", True)])
def test_a_onednn_cap_below_bf16_means_emulated_bf16(monkeypatch, cap, fast):
    """oneDNN capped below its bf16 ISA emulates bf16 even where the CPU has it: the flags alone would say fast."""
    cpu_bf16_fast.cache_clear()
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    try:
        assert cpu_bf16_fast("flags : fpu avx2 avx512f avx512_bf16\n") is fast
    finally:
        cpu_bf16_fast.cache_clear()
