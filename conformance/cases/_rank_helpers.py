"""Helpers shared by the placement, training and construction case files (not a case module).

[Note: CPU groups]
Cases that the catalogue pins to the CPU (``device_id=cpu`` on gloo) must stay
on the CPU even in the nightly GPU job, where the default process group may be
NCCL-only; they therefore take their groups from :func:`cpu_groups`, which
builds gloo groups only when the default backend cannot move CPU tensors.
GPU rows take their device from :func:`cuda_device` (the placement's device,
``ctx.device``), which also makes it the current device, as FSDP resolves an
index-less ``cuda`` device against it.

The device-placement contract (``device_id`` moves a CPU module; a module left
on the CPU without ``device_id`` stays there with a warning; device checks at
wrap and at the first forward) is FSDP1's constructor contract, so every case
exercising it requires :attr:`Capability.COMPUTE_DEVICE`, and those checking
its exact messages :attr:`Capability.PLACEMENT_MESSAGES`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from fixtures.meshes import hybrid_grid, hybrid_groups

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["cpu_groups", "cpu_world_group", "cuda_device", "env_on_all_ranks", "hybrid_cpu_groups",
           "setting_on_all_ranks"]

T = TypeVar("T")


def _default_backend_moves_cpu() -> bool:
    backend = str(dist.get_backend()).lower()
    return "gloo" in backend or "threaded" in backend or backend in ("fake", "mpi")


def cpu_groups(ctx: RankContext, layout: Sequence[Sequence[int]]) -> list[dist.ProcessGroup]:
    """One group per rank list in ``layout`` (created on every rank, in order) that moves CPU tensors."""
    if _default_backend_moves_cpu():
        return [ctx.new_group(list(ranks)) for ranks in layout]
    return [dist.new_group(list(ranks), backend="gloo") for ranks in layout]


def cpu_world_group(ctx: RankContext) -> dist.ProcessGroup | None:
    """``None`` (the default group) when it moves CPU tensors, else a world-sized gloo group."""
    if _default_backend_moves_cpu():
        return None
    return cpu_groups(ctx, [range(ctx.world_size)])[0]


def hybrid_cpu_groups(ctx: RankContext, shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ``(shard, replicate)`` pair that moves CPU tensors ([Note: hybrid layout]).

    With world 4 and shard 2: shard groups {0,1},{2,3}; replicate groups {0,2},{1,3}.
    """
    if _default_backend_moves_cpu():
        return hybrid_groups(ctx, shard_size)
    grid = hybrid_grid(ctx.world_size, shard_size)
    groups = cpu_groups(ctx, [*grid.tolist(), *grid.t().tolist()])
    row, column = divmod(ctx.rank, shard_size)
    return groups[row], groups[len(grid) + column]


def cuda_device(ctx: RankContext) -> torch.device:
    """The rank's GPU from its placement (``cuda:{rank}`` or a shared one), made the current device."""
    device = ctx.device
    if device.type != "cuda":
        raise RuntimeError(f"rank {ctx.rank} computes on {device}; a GPU row must declare gpus= in @case")
    torch.cuda.set_device(device)
    return device


@contextlib.contextmanager
def setting_on_all_ranks(ctx: RankContext, get: Callable[[], T], put: Callable[[T], None], value: T) -> Iterator[None]:
    """Put a process-wide setting (read by ``get``, written by ``put``) at ``value`` identically on every rank,
    then put back what it was.

    Under thread ranks the ranks share the process, so each reads the old value
    before any rank writes, the barriers make every rank see the new value before
    any rank proceeds, and the old value comes back only after every rank has
    finished with it.
    """
    old = get()
    ctx.barrier()
    put(value)
    ctx.barrier()
    try:
        yield
    finally:
        ctx.barrier()
        put(old)
        ctx.barrier()


def env_on_all_ranks(ctx: RankContext, name: str, value: str | None) -> contextlib.AbstractContextManager[None]:
    """Set (``None``: unset) an environment variable identically on every rank, then restore it
    (:func:`setting_on_all_ranks`)."""

    def put(new: str | None) -> None:
        if new is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = new

    return setting_on_all_ranks(ctx, lambda: os.environ.get(name), put, value)
