"""fully_shard_api: misuse of per-module sharding is refused when it happens, not discovered later.

- ``misuse[kind=reapply]``: ``fully_shard`` on a module that is already sharded raises.
- ``misuse[kind=container]``: ``fully_shard`` on an ``nn.ModuleList`` (a container without a
  ``forward``, so no forward hook could ever run) raises ``ValueError``.

Both are checked on every rank; the sharded model built before the misuse still trains like the
local model afterwards (a refused call leaves it as it was).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.optional import fully_shard
from fixtures.blocks import Blocks
from fixtures.parity import assert_close_named
from fixtures.sharded_blocks import LR, full_of, local_step, mesh_over, shard_blocks, sharded_step

if TYPE_CHECKING:
    from harness import RankContext


@case("fully_shard_api/misuse", clause="C7", world_size=TWO_OR_MORE, requires=[Capability.FULLY_SHARD], strategies=())
@pytest.mark.parametrize("kind", ["reapply", "container"])
def test_misuse(ctx: RankContext, impl: FSDPAdapter, kind: str) -> None:
    """``fully_shard`` on an already sharded module, or on a container without ``forward``, raises on every
    rank; the model built before still trains like the local model."""
    mesh = mesh_over(ctx)
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh)
    if kind == "reapply":
        with pytest.raises(Exception):  # noqa: B017 - the contract is that it refuses; torch and the reference differ in type
            fully_shard(impl, model.b2, mesh=mesh)
    else:
        container = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]).to(ctx.device)
        with pytest.raises(ValueError):
            fully_shard(impl, container, mesh=mesh)
    local = Blocks(seed=0).to(ctx.device)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        sharded_step(ctx, impl, model, optim, step)
        local_step(ctx, local, local_optim, step, range(ctx.world_size))
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters after {kind}")
