"""torch.distributed for training: the process group under torchrun, this rank's device, the DDP / FSDP2 wrap,
full (unsharded) state dicts, the few collectives the loop needs, and teardown.

In one process (no WORLD_SIZE, no process group) every collective here is a no-op, so the trainer reads the same
with one rank or many. Only training uses this module; capture keeps its own barrier-only group.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import nn

from eyas.errors import EyasError
from eyas.target.dist import destroy_process_group, init_process_group


@dataclass(frozen=True)
class Dist:
    """Where this process stands among the ranks."""

    rank: int
    """This process's rank (0 in one process)."""
    world: int
    """Number of ranks (1 in one process)."""
    device: torch.device
    """The device this rank trains on (cuda:LOCAL_RANK under torchrun on GPUs)."""
    owns_group: bool = False
    """setup() created the process group, so teardown() destroys it; a group the caller made stays."""
    restore: tuple[bool, bool] | None = None
    """(deterministic algorithms, cudnn.benchmark) as they were before a deterministic setup(); teardown() puts them
    back, so what runs after training in the same process (eyas run's bench) does not inherit them."""


def setup(device: str, *, deterministic: bool = False) -> Dist:
    """Join the ranks (NCCL on CUDA, gloo on the CPU) when torchrun set WORLD_SIZE > 1, and pick this rank's device.

    `device` is TrainConfig.device: 'auto', 'cpu', 'cuda' or 'cuda:N'. A process group the caller already
    initialised is used as it is. `deterministic` turns on torch's deterministic algorithms (and the cuBLAS
    workspace setting they need) before anything touches the device."""
    restore = None
    if deterministic:
        restore = switches()
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    owns = world > 1 and not tdist.is_initialized()
    if owns:
        init_process_group("nccl" if want_cuda else "gloo")
    rank, world = (tdist.get_rank(), tdist.get_world_size()) if tdist.is_initialized() else (0, 1)
    if want_cuda:
        if not torch.cuda.is_available():
            raise EyasError(f"--device {device}: CUDA is not available on this machine")
        if world > 1:
            idx = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            idx = 0 if device == "auto" else (torch.device(device).index or 0)
        dev = torch.device("cuda", idx)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    return Dist(rank=rank, world=world, device=dev, owns_group=owns, restore=restore)


def switches() -> tuple[bool, bool]:
    """(deterministic algorithms, cudnn.benchmark): the process-wide switches a deterministic setup() turns."""
    return torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark


def set_switches(state: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(state[0])
    torch.backends.cudnn.benchmark = state[1]


def teardown(d: Dist) -> None:
    """Destroy the process group if setup() created it (after a finished run: every rank is past its last barrier),
    and put back what a deterministic setup() switched."""
    if d.owns_group and tdist.is_initialized():
        destroy_process_group()
    if d.restore is not None:
        set_switches(d.restore)


def _on() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def barrier() -> None:
    if _on():
        tdist.barrier()


def long_barrier(hours: float = 2.0) -> None:
    """A barrier that may wait hours (a CPU group of its own), where ranks do unequal long work first, e.g. hashing
    their share of a large store: the default group's NCCL barrier would time out after 10 minutes."""
    if _on():
        group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(hours=hours))
        tdist.barrier(group=group)
        tdist.destroy_process_group(group)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any rank (all-reduce MAX)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if _on():
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.item() > 0


def max_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Elementwise max of `t` over the ranks, on every rank (in place; `t` itself in one process)."""
    if _on():
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t


def gather_lists(local: list) -> list:
    """Every rank's `local` list, concatenated in rank order, on every rank."""
    if not _on():
        return list(local)
    gathered = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, local)
    return [x for g in gathered for x in g]


# ------------------------------------------------------------------------------------------ the wrap
def parallelize(module: nn.Module, d: Dist, *, fsdp: bool, shard_first: tuple[nn.Module, ...] = ()) -> nn.Module:
    """The module the training loop calls: FSDP2 (fully_shard on each of `shard_first`, then on `module`, in
    place), DDP over the ranks, or `module` itself in one process. `module` keeps its own state-dict keys."""
    if fsdp:
        if d.world < 2:
            raise EyasError("--fsdp needs torchrun with at least 2 processes")
        from torch.distributed.fsdp import fully_shard
        for m in shard_first:
            fully_shard(m)
        fully_shard(module)
        return module
    if d.world > 1:
        return nn.parallel.DistributedDataParallel(module, device_ids=[d.device.index] if d.device.type == "cuda"
                                                   else None)
    return module


def sync_grads(model: nn.Module, last: bool):
    """Context for one micro-batch's backward: DDP all-reduces the gradients only on the `last` one."""
    if last or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


# ------------------------------------------------------------------------------------ state dicts
def full_state_dict(module: nn.Module, optim, fsdp: bool) -> tuple[dict, dict | None]:
    """Full (unsharded, CPU) model state dict of `module` and the optimizer's state (None without an optimizer).

    A collective under FSDP2: every rank calls it. Without FSDP the CPU tensors may share storage with the live
    ones (`.cpu()` of a CPU tensor is itself): save or copy them before the next step."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(module, options=opts)
        opt = get_optimizer_state_dict(module, optim, options=opts) if optim is not None else None
    else:
        model = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        opt = optim.state_dict() if optim is not None else None
    return model, opt


def load_full_state_dict(module: nn.Module, optim, model_state: dict, opt_state: dict, fsdp: bool) -> None:
    """The inverse of full_state_dict: every rank loads the full dicts (FSDP2 keeps only its shards)."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, model_state, options=opts)
        set_optimizer_state_dict(module, optim, opt_state, options=opts)
    else:
        module.load_state_dict(model_state)
        optim.load_state_dict(opt_state)
