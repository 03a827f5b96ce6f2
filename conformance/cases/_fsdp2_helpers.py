"""What the FSDP2-shaped cases share: sharding :class:`fixtures.blocks.Blocks` with an adapter's
``fully_shard``, reading full parameters back, and the local model they train alike with."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.contract.adapter import FSDPAdapter
from conformance.contract.optional import fully_shard
from fixtures.blocks import Blocks, block_batch

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["mesh_over", "shard_blocks", "full_of", "local_step", "sharded_step", "unit_bytes", "LR"]

LR = 0.1


def mesh_over(ctx: RankContext, group: dist.ProcessGroup | None = None) -> Any:
    """A 1-D mesh over the world, or over ``group`` (every rank of the group calls it)."""
    if group is None:
        return ctx.device_mesh((ctx.world_size,))
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, ctx.device.type)


def shard_blocks(
    impl: FSDPAdapter,
    model: Blocks,
    mesh: Any,
    *,
    reshard_after_forward: bool | int = True,
    ignored_params: Iterable[nn.Parameter] = (),
) -> Blocks:
    """Every block its own unit, then the root (which keeps ``head``)."""
    ignored = frozenset(ignored_params)
    for block in model.blocks():
        fully_shard(impl, block, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    fully_shard(impl, model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    return model


def full_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole: a DTensor's ``full_tensor()`` (collective), a plain tensor as it is."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = full.detach().clone()
    return out


def sharded_step(ctx: RankContext, model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One step on this rank's batch (the implementation averages gradients over the mesh)."""
    optim.zero_grad(set_to_none=True)
    model(block_batch(step, ctx.rank, ctx.device)).sum().backward()
    optim.step()


def local_step(ctx: RankContext, model: nn.Module, optim: torch.optim.Optimizer, step: int,
               ranks: Sequence[int]) -> None:
    """The same step unsharded: the mean of ``ranks``' losses, so the gradient is their mean."""
    optim.zero_grad(set_to_none=True)
    loss = sum(model(block_batch(step, rank, ctx.device)).sum() for rank in ranks)
    (loss / len(ranks)).backward()  # type: ignore[operator]
    optim.step()


def unit_bytes(model: Blocks, shard_size: int) -> dict[str, int]:
    """unit -> the bytes one rank contributes to its all-gather: each parameter's largest
    ``torch.chunk`` piece over ``shard_size`` ranks (the local size of a ``Shard(0)`` DTensor)."""
    units: dict[str, nn.Module] = {"root": model.head, "b1": model.b1, "b2": model.b2, "b3": model.b3}
    out = {}
    for name, module in units.items():
        total = 0
        for param in module.parameters():
            rows = -(-param.shape[0] // shard_size)
            total += rows * param[0].numel() * param.element_size()
        out[name] = total
    return out
