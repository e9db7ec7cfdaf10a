"""Opening and closing torch.distributed's default process group, for every stage that runs one process per rank
(capture's barriers, training's data parallelism: train/dist.py)."""

from __future__ import annotations

import gc

import torch.distributed as tdist


def init_process_group(backend: str) -> None:
    """tdist.init_process_group, after importing the torch modules that bind `group.WORLD` as a default argument.

    torch.distributed.nn.functional (pulled in by torch._dynamo, which the first optimizer's constructor imports)
    and a few others evaluate `group.WORLD` when imported: imported after the group exists, their defaults hold it
    for the life of the interpreter, destroy_process_group cannot free it, and gloo's worker and TCP-loop threads
    live on into interpreter teardown, where they can abort the process ("terminate called without an active
    exception"). Imported first, the defaults are None."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.nn  # noqa: F401
    tdist.init_process_group(backend=backend)


def destroy_process_group() -> None:
    """Free the wrapped models that still hold the group (FSDP2's modules sit in reference cycles), then destroy it,
    so that its backend (gloo's threads) goes now rather than during interpreter teardown. torch's own caches may
    still hold it (DTensor's lru_caches keep FSDP2's device mesh, and the mesh the group)."""
    gc.collect()
    tdist.destroy_process_group()
    gc.collect()
