"""memory: sharding saves memory a rank can count.

- ``peak_per_rank``: during a training step (forward, backward, optimizer
  step) a rank's tensors never hold more than

      ``B = (P + G + S) / W  +  K * U  +  A``

  where ``P``, ``G``, ``S`` are the bytes of the model's parameters, their
  gradients and the optimizer state (SGD with momentum: one buffer per
  parameter), unsharded, ``W`` the world size, ``U`` the bytes of the largest
  unit's parameters, unsharded, and ``A`` the bytes of the activations
  autograd keeps (two per layer: its input and its tanh output).
  ``K = 5`` units' worth of unsharded bytes are allowed at once: the running
  unit's gathered parameters, the next unit's prefetched ones, the running
  unit's gradient twice (as autograd computes it and as the unit's unsharded
  gradient it is added into, or the staging buffer of its reduce-scatter),
  and the previous unit's unsharded gradient while its reduction is in flight.
  ``K`` does not grow with depth: an implementation that keeps
  every unit's gathered parameters, or every unit's unsharded gradient, adds
  about ``P (W - 1) / W``, which the model's 16 equal units put far past ``B``.
  Bytes are counted by :func:`fixtures.memory.track_storages` (tensor
  storages created on this rank, at every op, outside collectives;
  [Note: storage accounting]), so the CPU measures what a GPU's allocator
  would hold for tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn as nn

from conformance.contract.adapter import AutoWrap, FSDPAdapter, WrapSpec
from conformance.contract.case import case
from conformance.contract.results import CaseReport
from fixtures.memory import LinearStack, track_storages
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

WIDTH, DEPTH, BATCH = 64, 16, 2
#: Units' worth of unsharded bytes allowed at once (see the module docstring).
K_UNITS = 5


def _bound(model: LinearStack, world_size: int) -> dict[str, int]:
    """The terms of ``B`` for ``model`` (a plain, unsharded :class:`LinearStack`)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    unit = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers)
    activations = 2 * DEPTH * BATCH * WIDTH * 4
    sharded = 3 * params // world_size  # parameters, gradients, momentum
    return {"sharded": sharded, "unit": unit, "activations": activations,
            "bound": sharded + K_UNITS * unit + activations}


def _step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    optim.step()


@case("memory/peak_per_rank", world_size=2, strategies=["FULL_SHARD"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_peak_per_rank(ctx: RankContext, impl: FSDPAdapter, use_orig_params: bool) -> CaseReport:
    """During a training step a rank's tensor storages never exceed the bound ``B`` of the module
    docstring (sharded state over the world size plus five units unsharded plus activations)."""
    terms = _bound(LinearStack(WIDTH, DEPTH), ctx.world_size)
    gen = generator(rank_seed(3, ctx.rank))
    batches = [torch.randn(BATCH, WIDTH, generator=gen).to(ctx.device) for _ in range(2)]
    with track_storages() as tracker:
        model = impl.wrap(
            LinearStack(WIDTH, DEPTH).to(ctx.device),
            WrapSpec(auto_wrap=AutoWrap((nn.Linear,)), use_orig_params=use_orig_params),
        )
        optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        _step(model, optim, batches[0])  # creates the momentum buffers
        tracker.reset_peak()
        _step(model, optim, batches[1])
        peak = tracker.peak
    over = peak - terms["bound"]
    assert over <= 0, (
        f"rank {ctx.rank}: peak {peak} B during a step exceeds the bound {terms['bound']} B by {over} B "
        f"(sharded parameters+gradients+state {terms['sharded']} B, {K_UNITS} units of {terms['unit']} B, "
        f"activations {terms['activations']} B)"
    )
    return CaseReport(reason=f"peak {peak} B <= bound {terms['bound']} B",
                      metrics={"peak_bytes": peak, **{f"{k}_bytes": v for k, v in terms.items()}})
