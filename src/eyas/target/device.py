"""What the machine has and does fast: free memory for a target, bf16 on this CPU or not.

A CPU without bf16 instructions (AVX512-BF16 or AMX) emulates bf16 matmuls, orders of magnitude slower than fp32
(docs/LOG.md has the measurement). The cpu-demo's bf16 settings would then be far slower, not faster, so presets
ask `cpu_bf16_fast()` before choosing bf16.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's cap on the instructions it uses (torch's CPU matmuls run through it): a cap below AVX512_CORE_BF16
(AVX2, say) emulates bf16 on any CPU."""


@functools.cache
def cpu_bf16_fast(cpuinfo: str | None = None) -> bool:
    """True when the CPU has native bf16 matmul instructions (Linux /proc/cpuinfo flags, else torch's report) and
    oneDNN may use them (ISA_CAPS)."""
    cap = next((os.environ[k] for k in ISA_CAPS if os.environ.get(k)), "").upper()
    if cap and cap != "ALL" and not any(x in cap for x in ("BF16", "AMX", "AVX10")):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    if flags:
        return any(f in flags for f in BF16_FLAGS)
    import torch

    return any(x in torch.backends.cpu.get_cpu_capability() for x in ("BF16", "AMX"))


def memory(device) -> tuple[int, int] | None:
    """(bytes free now, bytes in all) of `device`: torch.cuda.mem_get_info on CUDA; MemAvailable and MemTotal of
    /proc/meminfo for the CPU (physical pages where there is none); None where it cannot be told."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return torch.cuda.mem_get_info(device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        return None
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(info["MemAvailable"].split()[0]) * 1024, int(info["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return pages, pages


def free_bytes(device) -> int | None:
    """Memory a load onto `device` can take now (memory()'s first number)."""
    mem = memory(device)
    return None if mem is None else mem[0]
