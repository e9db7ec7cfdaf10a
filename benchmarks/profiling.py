"""Small torch.profiler helpers shared by the benchmarks: which activities to record, the device work a profile
holds (kernels on CUDA, aten ops on the CPU) grouped into attention / matmul / elementwise+other, the host's launch
calls and waits, and the device's copy bandwidth (what a memory-bound step is measured against)."""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

ATTENTION = re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)
MATMUL = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|aten::(mm|addmm|bmm|baddbmm|linear)$", re.I)
SYNC = re.compile(r"Sync|^Stream Wait")
LAUNCH = re.compile(r"^cu(da)?(LaunchKernel|LaunchKernelEx|LaunchCooperativeKernel|GraphLaunch)")
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "aten::item", "aten::nonzero")
"""Host-side events that wait for (or, on the CPU, stand for) a value computed on the device. cudaDeviceSynchronize is
left out: the benchmarks bracket their profiled windows with it."""


def activities(device: torch.device) -> list:
    """CPU activity, plus CUDA's when the work runs there."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def group(name: str) -> str:
    """The kind of a kernel or op, by its name: attention, matmul, or elementwise+other (norms, RoPE, copies,
    sampling, index writes)."""
    if ATTENTION.search(name):
        return "attention"
    if MATMUL.search(name):
        return "matmul"
    return "elementwise+other"


def device_work(prof, device: torch.device) -> list[tuple[str, float]]:
    """(name, microseconds) of each unit of device work in the profile: every kernel, memcpy and memset on CUDA;
    every aten op's self time on the CPU (the CPU is the device there, and the ops run one after another on
    the calling thread, so their sum is at most the wall time)."""
    out = []
    for e in prof.events():
        if device.type == "cuda":
            # Kernels, memcpys and memsets; not the device-side sync records or user-annotation ranges (kineto
            # files those under the device too), which span waits rather than work.
            if (e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                    and not SYNC.search(e.name)):
                out.append((e.name, e.time_range.elapsed_us()))
        elif e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            out.append((e.name, e.self_cpu_time_total))
    return out


def host_calls(prof) -> tuple[int, int, dict[str, int]]:
    """(launch calls, of which graph launches, {wait event name: count}) among the host-side events."""
    launches = graphs = 0
    waits = dict.fromkeys(WAITS, 0)
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            continue
        if LAUNCH.match(e.name):
            launches += 1
            graphs += "GraphLaunch" in e.name
        for w in WAITS:  # by prefix: CUPTI may name a runtime call with a version suffix
            if e.name.startswith(w):
                waits[w] += 1
    return launches, graphs, waits


def by_kernel(work: list[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """(name, count, total us) per distinct name, most time first."""
    n, t = defaultdict(int), defaultdict(float)
    for name, us in work:
        n[name] += 1
        t[name] += us
    return sorted(((k, n[k], t[k]) for k in t), key=lambda r: -r[2])


def copy_bandwidth(device: torch.device, mib: int, reps: int = 10) -> float:
    """Bytes/s of a `mib` MiB device-to-device copy, counting the read and the write (2 x mib per copy): the rate a
    step that streams its weights and cache can at best reach."""
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    dt = time.perf_counter() - t0
    del src, dst
    return 2 * n * reps / dt
