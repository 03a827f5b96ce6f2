"""meta_init: a model built on the meta device, sharded, then materialized, equals one built normally.

- ``reset_parameters``: :class:`fixtures.blocks.Blocks` built under ``torch.device("meta")``
  (no storage), every block and the root ``fully_shard``-ed, then ``to_empty(device=...)`` and a
  reset that fills each parameter from the full tensor a private generator draws (for a DTensor,
  this rank's ``Shard(0)`` piece of it, the layout the capability promises). Its parameters equal,
  bit for bit, those of the same model built on the device and reset the same way; two training
  steps later they still equal a local model's (the reset reached the shards the all-gathers read).
- ``load_state_dict_assign``: the same model built on ``meta`` and sharded, then given its values by
  ``load_state_dict(sd, assign=True)`` with a sharded state dict: each entry a new ``nn.Parameter`` holding a
  DTensor ``distribute_tensor`` made from the local model's full tensor with the placements and mesh of the
  model's own ``state_dict()`` entry (torch's FSDP2 tutorial, "Loading state dicts"). The loaded parameter
  objects replace the sharded ones: the parameters then equal the local model's bit for bit, and two training
  steps with an optimizer built on them later they still equal a local model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, case
from fixtures.blocks import Blocks
from fixtures.parity import COPIED, assert_close_named
from fixtures.seeding import generator
from fixtures.sharded_blocks import full_of, mesh_over, shard_blocks, trains_as_local

if TYPE_CHECKING:
    from harness import RankContext


@torch.no_grad()
def _reset(model: nn.Module) -> None:
    """Every parameter from a generator seeded by its position: the same values for any layout."""
    for index, (_, param) in enumerate(model.named_parameters()):
        full = torch.randn(param.shape, generator=generator(1000 + index)).to(param.device)
        if hasattr(param, "device_mesh"):  # a DTensor: this rank's piece of the full tensor
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)


@case("meta_init/reset_parameters", clause="C16", world_size=TWO_OR_MORE,
      requires=[Capability.FULLY_SHARD, Capability.META_INIT],
      strategies=())
def test_reset_parameters(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A model built on ``meta``, sharded, materialized and reset equals, bit for bit, the same model built
    on the device; two training steps later it still equals a local model's."""
    local = Blocks(seed=0).to(ctx.device)
    _reset(local)
    with torch.device("meta"):
        meta = Blocks(seed=0)
    model = shard_blocks(impl, meta, mesh_over(ctx))
    model.to_empty(device=ctx.device)
    _reset(model)
    assert_close_named(full_of(model), dict(local.named_parameters()),
                       what=f"rank {ctx.rank}: parameters after to_empty and reset", exact=COPIED)
    trains_as_local(ctx, impl, model, local, momentum=0.9, what="trained")


def _sharded_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, nn.Parameter]:
    """``full``'s values laid out as ``model.state_dict()``'s DTensors (this rank's pieces), each a new
    ``nn.Parameter``: what ``load_state_dict(..., assign=True)`` puts in place of the sharded parameters."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for name, entry in model.state_dict().items():
        value = full[name].detach().to(entry.dtype)
        out[name] = nn.Parameter(distribute_tensor(value, entry.device_mesh, entry.placements, src_data_rank=None))
    return out


@case("meta_init/load_state_dict_assign", clause="C16", world_size=TWO_OR_MORE,
      requires=[Capability.FULLY_SHARD, Capability.META_INIT],
      strategies=())
def test_load_state_dict_assign(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A model built on ``meta`` and sharded, then loaded with ``load_state_dict(sharded_sd, assign=True)``, equals
    the local model bit for bit; trained two steps with an optimizer over the loaded parameters, it still does."""
    local = Blocks(seed=0).to(ctx.device)
    with torch.device("meta"):
        meta = Blocks(seed=0)
    model = shard_blocks(impl, meta, mesh_over(ctx))
    model.load_state_dict(_sharded_state_dict(model, dict(local.named_parameters())), assign=True)
    assert_close_named(full_of(model), dict(local.named_parameters()),
                       what=f"rank {ctx.rank}: parameters after load_state_dict(assign=True)", exact=COPIED)
    trains_as_local(ctx, impl, model, local, momentum=0.9, what="trained")
