"""fully_shard_options: the less common ``FSDPModule`` methods, ``fully_shard`` arguments and
``MixedPrecisionPolicy`` fields, each by what a user reads back against the local model
(``fixtures.sharded_blocks``; torch 2.13's docstrings are the oracle).

- ``is_last_backward``: two micro-batches per step, the first backward marked as not the last: after the
  last one the full gradients are the local model's for both micro-batches (what a backward that is not the
  last leaves unfinished is the implementation's; only the last one's gradients are read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conformance.contract import optional
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, case
from fixtures.blocks import Blocks, block_batch
from fixtures.parity import assert_close_named
from fixtures.sharded_blocks import LR, full_grads_of, full_of, local_grads, mesh_over, shard_blocks

if TYPE_CHECKING:
    from harness import RankContext


@case("fully_shard_options/is_last_backward", clause="C3", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.IS_LAST_BACKWARD])
def test_is_last_backward(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The root's ``set_is_last_backward(False)`` before the first of two micro-batches' backwards, ``True``
    before the second: the full gradients are then the local model's for both, and two such steps leave the
    local model's parameters."""
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx))
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = Blocks(seed=0).to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for cycle in range(2):
        optim.zero_grad(set_to_none=True)
        local_optim.zero_grad(set_to_none=True)
        for micro, last in enumerate((False, True)):
            optional.set_is_last_backward(impl, model, last)
            model(block_batch(2 * cycle + micro, ctx.rank, ctx.device)).sum().backward()
        expected = local_grads(ctx, range(2 * cycle, 2 * cycle + 2), local)
        assert_close_named(full_grads_of(model), expected, what=f"rank {ctx.rank}: gradients of cycle {cycle}")
        optional.step(impl, model, optim)
        local_optim.step()
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")
