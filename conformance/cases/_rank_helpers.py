"""Helpers shared by the placement and training case files (not a case module).

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

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fixtures.meshes import hybrid_grid, hybrid_groups

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["cpu_groups", "cpu_world_group", "cuda_device", "hybrid_cpu_groups"]


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
