"""reshard: ``reshard_after_forward`` and explicit prefetch lists, seen in the all-gathers a rank issues.

Every block of :class:`fixtures.blocks.Blocks` is a unit and the root keeps ``head``; the units'
sizes differ by 1.4x or more, so an all-gather names its unit by its bytes (the closest of
:func:`unit_bytes`: each parameter's ``Shard(0)`` piece).

- ``after_forward[setting=True|False|2]`` (4 ranks): forward all-gathers every unit once over the
  mesh. Backward all-gathers, per setting: ``True``, every unit again over 4 ranks (the root too:
  it was resharded); ``False``, nothing (every unit kept what forward gathered); ``2``, every unit
  again over 2 ranks (each rank kept its pair's share). Two steps alike, then the parameters equal
  a local model's trained on the same batches.
- ``explicit_prefetch`` (2 ranks): every unit is all-gathered once in forward and once in
  backward; with ``b1`` prefetching ``[b3, b2]`` in forward and the root ``[b2, b3]`` in backward,
  the all-gathers right after b1's in forward are b3's then b2's, and right after the root's in
  backward b2's then b3's (the declared order; without lists the order is the implementation's
  own). Training with the lists equals the local model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, Scalable, case
from conformance.contract.optional import set_modules_to_prefetch
from fixtures.blocks import Blocks, block_batch
from fixtures.parity import assert_close_named
from fixtures.sharded_blocks import LR, full_of, local_step, mesh_over, shard_blocks, unit_bytes

if TYPE_CHECKING:
    from harness import RankContext

AG = "all_gather_into_tensor"
UNITS = ["root", "b1", "b2", "b3"]


def _gathers(trace: Any, sizes: Mapping[str, int], mesh_size: int) -> list[tuple[str, int]]:
    """(unit, group size) of every all-gather in ``trace``; the unit is the one closest in bytes
    (over a smaller group a rank sends the share of ``mesh_size / group size`` ranks). One all-gather
    per unit and direction is ``fully_shard``'s grouping (``Capability.FULLY_SHARD``: a module's
    parameters are gathered together), not a count of this case's choosing."""
    out = []
    for call in trace.calls:
        if call.op == AG:
            ranks = len(call.group_ranks)
            sent = max(call.bytes, 1) * ranks / mesh_size
            unit = min(sizes, key=lambda name: abs(math.log(sent / sizes[name])))
            out.append((unit, ranks))
    return out


def _following(order: list[str], unit: str, count: int) -> list[str]:
    """The ``count`` all-gathers issued right after ``unit``'s."""
    start = order.index(unit) + 1 if unit in order else len(order)
    return order[start : start + count]


def _after_forward_requires(params: Mapping[str, Any]) -> list[Capability]:
    caps = [Capability.FULLY_SHARD]
    if not isinstance(params.get("setting"), bool):
        caps.append(Capability.RESHARD_AFTER_FORWARD_INT)
    return caps


def _recorded_step(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, optim: torch.optim.Optimizer,
                   local: nn.Module, local_optim: torch.optim.Optimizer, step: int) -> tuple[Any, Any]:
    """One SGD step of ``model`` on this rank's batch and of ``local`` on every rank's; the collectives the
    forward and the backward issued, recorded apart."""
    optim.zero_grad(set_to_none=True)
    with ctx.record_collectives() as forward:
        loss = model(block_batch(step, ctx.rank, ctx.device)).sum()
    with ctx.record_collectives() as backward:
        loss.backward()
    optional.step(impl, model, optim)
    local_step(ctx, local, local_optim, step, range(ctx.world_size))
    return forward, backward


@case("reshard/after_forward", clause="C11", world_size=Scalable(default=4, minimum=2, multiple_of=2),
      requires=_after_forward_requires, strategies=())
@pytest.mark.parametrize("setting", [True, False, 2])
def test_after_forward(ctx: RankContext, impl: FSDPAdapter, setting: bool | int) -> None:
    """Backward all-gathers every unit again over the mesh (``True``), nothing (``False``) or over 2 ranks
    (``2``); after two steps the parameters equal a local model's."""
    ws = ctx.world_size
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx), reshard_after_forward=setting)
    local = Blocks(seed=0).to(ctx.device)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    sizes = unit_bytes(local, ws)
    regather = {True: ws, False: 0, 2: 2}[setting]
    want_backward = [(unit, regather) for unit in ["root", "b3", "b2", "b1"]] if regather else []
    for step in range(2):
        forward, backward = _recorded_step(ctx, impl, model, optim, local, local_optim, step)
        got = (sorted(_gathers(forward, sizes, ws)), sorted(_gathers(backward, sizes, ws)))
        want = (sorted((unit, ws) for unit in UNITS), sorted(want_backward))
        assert got == want, (
            f"rank {ctx.rank} step {step} reshard_after_forward={setting}: all-gathers (unit, group size) "
            f"in forward, backward {got}, expected {want}\nforward:\n{forward.render()}\nbackward:\n{backward.render()}"
        )
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


@case("reshard/explicit_prefetch", world_size=TWO_OR_MORE,
      requires=[Capability.FULLY_SHARD, Capability.EXPLICIT_PREFETCH],
      clause="C11",
      strategies=())
def test_explicit_prefetch(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The all-gathers right after the declaring unit's are the declared prefetch list's, in its order, in
    forward and backward; training with the lists equals the local model."""
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx))
    local = Blocks(seed=0).to(ctx.device)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    ws = ctx.world_size
    sizes = unit_bytes(local, ws)
    for step, explicit in enumerate((False, True, True)):
        if explicit:
            set_modules_to_prefetch(impl, model.b1, forward=[model.b3, model.b2])
            set_modules_to_prefetch(impl, model, backward=[model.b2, model.b3])
        forward, backward = _recorded_step(ctx, impl, model, optim, local, local_optim, step)
        order = ([u for u, _ in _gathers(forward, sizes, ws)], [u for u, _ in _gathers(backward, sizes, ws)])
        label = f"rank {ctx.rank} step {step} ({'with' if explicit else 'without'} prefetch lists)"
        assert sorted(order[0]) == sorted(order[1]) == sorted(UNITS), (
            f"{label}: every unit all-gathered once in forward and once in backward, got {order}"
        )
        if explicit:
            got = (_following(order[0], "b1", 2), _following(order[1], "root", 2))
            assert got == (["b3", "b2"], ["b2", "b3"]), (
                f"{label}: all-gathers right after b1's in forward, after the root's in backward: {got}, "
                f"expected the declared ['b3', 'b2'], ['b2', 'b3'] (orders {order})"
            )
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")
