"""One CUDA-graph capture helper, for the runner's decode/verify steps and the graphed drafter.

`capture(fn, *args)` warms `fn(*args)` up on a side stream (lazy allocations, cuBLAS handles, compiled
kernels), records one call into a CUDA graph and returns `run()`, which replays it and returns the tensors
the recorded call returned. The caller owns `args` as static buffers and refills them in place before each
`run()`. Off CUDA there is nothing to capture and `run()` is a plain call.
"""

from __future__ import annotations

import torch


def capture(fn, *args, warmup: int = 2, cuda: bool | None = None):
    """-> run() replaying fn(*args). `cuda` says whether fn runs on the GPU (default: the first arg's device)."""
    if cuda is None:
        cuda = bool(args) and args[0].device.type == "cuda"
    if not cuda:
        return lambda: fn(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)

    def run():
        graph.replay()
        return out
    return run
