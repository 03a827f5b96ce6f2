"""Every collective the reference issues, as free functions taking the group explicitly.

[Note: collectives are looked up at call time]
Each function resolves its ``torch.distributed`` function by attribute lookup when
it is called (``dist.all_gather_single`` when torch has it, else
``dist.all_gather_into_tensor``; likewise for reduce-scatter). Tracing and
fault-injection tools patch those module attributes, so binding them at import
time would hide our traffic from them. Every call passes ``async_op=True`` and
returns a :class:`Pending` whose ``wait()`` is called only where the result is
consumed: nothing here blocks the compute path.

[Note: gradient averaging]
Gradients are reduced with SUM and divided explicitly by the data-parallel world
size (shard size x replicate size) after the last reduction, never with
``ReduceOp.AVG`` (gloo does not implement it, and the thread group's AVG is not
what DDP does). DDP divides the same way, so parity is exact for power-of-two
world sizes and within float rounding otherwise. A unit given a divide factor
(``FSDPModule.set_gradient_divide_factor``) divides by it instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "Pending",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "group_size",
    "group_rank",
]


class Pending(NamedTuple):
    """An issued collective: ``output`` is valid only after ``wait()``."""

    work: Any
    output: torch.Tensor

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.output


def _resolve(new_name: str, old_name: str) -> Any:
    fn = getattr(dist, new_name, None)
    return fn if fn is not None else getattr(dist, old_name)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group`` (``None`` means the default group)."""
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within ``group``."""
    return dist.get_rank(group)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None
) -> Pending:
    """Gather equal ``shard`` pieces from every rank of ``group`` into ``output`` (rank order)."""
    if output.numel() != shard.numel() * group_size(group):
        raise ValueError(
            f"all_gather output numel({output.numel()}) != shard numel({shard.numel()}) "
            f"* group size({group_size(group)})"
        )
    fn = _resolve("all_gather_single", "all_gather_into_tensor")
    return Pending(fn(output, shard, group=group, async_op=True), output)


def reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None
) -> Pending:
    """SUM ``full`` over ``group`` and leave this rank's contiguous piece in ``output``."""
    if full.numel() != output.numel() * group_size(group):
        raise ValueError(
            f"reduce_scatter input numel({full.numel()}) != output numel({output.numel()}) "
            f"* group size({group_size(group)})"
        )
    fn = _resolve("reduce_scatter_single", "reduce_scatter_tensor")
    work = fn(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, output)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> Pending:
    """Reduce ``tensor`` in place over ``group`` (SUM unless ``op`` says otherwise)."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, tensor)


def broadcast(tensor: torch.Tensor, src_rank: int, group: dist.ProcessGroup | None) -> Pending:
    """Overwrite ``tensor`` on every rank with global rank ``src_rank``'s value."""
    work = dist.broadcast(tensor, src=src_rank, group=group, async_op=True)
    return Pending(work, tensor)
