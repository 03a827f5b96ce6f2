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
- ``dropped_model_freed``: a model trained for two steps, then dropped by its
  user (model, optimizer, output, loss), is freed once Python's cycle collector
  has run. Nothing the implementation registered (hooks on its tensors,
  callbacks, registries) may keep it alive, with its parameters, gradients and
  process groups: a training loop that builds a model per trial (a sweep, a
  fuzzer, a notebook) would otherwise hold every earlier one, and each gloo
  group keeps three threads until it is freed. Before dropping it the row makes
  the call the implementation documents for letting a model go, if any
  (``release``, optional: DeepSpeed's ``engine.destroy()``).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.optional import fully_shard
from conformance.contract.results import CaseReport
from fixtures.memory import LinearStack, kept_alive, track_storages
from fixtures.seeding import generator, rank_seed
from fixtures.sharded_blocks import mesh_over

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


def _step(impl: FSDPAdapter, model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    optional.step(impl, model, optim)


@case("memory/peak_per_rank", clause="C9", world_size=TWO_OR_MORE, strategies=["FULL_SHARD"])
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
        optim = optional.optimizer(impl, model, torch.optim.SGD, lr=1e-2, momentum=0.9)
        _step(impl, model, optim, batches[0])  # creates the momentum buffers
        tracker.reset_peak()
        _step(impl, model, optim, batches[1])
        peak = tracker.peak
    over = peak - terms["bound"]
    assert over <= 0, (
        f"rank {ctx.rank}: peak {peak} B during a step exceeds the bound {terms['bound']} B by {over} B "
        f"(sharded parameters+gradients+state {terms['sharded']} B, {K_UNITS} units of {terms['unit']} B, "
        f"activations {terms['activations']} B)"
    )
    return CaseReport(reason=f"peak {peak} B <= bound {terms['bound']} B",
                      metrics={"peak_bytes": peak, **{f"{k}_bytes": v for k, v in terms.items()}})


def _dropped_requires(params: Mapping[str, Any]) -> list[Capability]:
    return [Capability.FULLY_SHARD] if params.get("api") == "fully_shard" else []


def _sharded(ctx: RankContext, impl: FSDPAdapter, model: LinearStack, api: str, units: str) -> nn.Module:
    """``model`` sharded by ``api``: the root its one unit, or each layer a unit under it (``units``)."""
    layers = model.layers if units == "per_layer" else []
    if api == "wrap":
        return impl.wrap(model, WrapSpec(auto_wrap=AutoWrap((nn.Linear,)) if layers else None))
    mesh = mesh_over(ctx)
    for layer in layers:
        fully_shard(impl, layer, mesh=mesh)
    return fully_shard(impl, model, mesh=mesh)


@case("memory/dropped_model_freed", clause="C10", world_size=TWO_OR_MORE, requires=_dropped_requires)
@pytest.mark.parametrize("api", ["wrap", "fully_shard"])
@pytest.mark.parametrize("last", ["step", "forward"])
@pytest.mark.parametrize("units", ["root", "per_layer"])
def test_dropped_model_freed(ctx: RankContext, impl: FSDPAdapter, api: str, last: str, units: str) -> CaseReport:
    """The user's module, sharded by ``api`` and trained two steps, is freed once the user has dropped the
    model, its optimizer and its last output and the cycle collector has run (see the module docstring);
    ``last="forward"``: a forward with gradients came after the steps, and its backward never ran (an
    exception between the two, an evaluation without ``no_grad``); ``units``: the root the one unit, or each
    layer a unit under a root holding no parameters."""
    user = LinearStack(8, 3).to(ctx.device)
    watched = weakref.ref(user)
    model = _sharded(ctx, impl, user, api, units)
    del user
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=1e-2, momentum=0.9)
    gen = generator(rank_seed(5, ctx.rank))
    for _ in range(2):
        _step(impl, model, optim, torch.randn(BATCH, 8, generator=gen).to(ctx.device))
    output = model(torch.randn(BATCH, 8, generator=gen).to(ctx.device)).sum() if last == "forward" else None
    optional.release(impl, model)  # the implementation's own way of letting a model go, if it has one
    del model, optim, output
    ctx.barrier()  # every rank past its collectives: a thread rank's peer may hold its tensors in one in flight
    kept = kept_alive(watched)
    if kept is not None:
        after = "two training steps" if last == "step" else "two training steps and a forward with no backward"
        raise AssertionError(f"rank {ctx.rank}: the {api} model, dropped by its user after {after}, is "
                             f"still alive after gc.collect(), {kept}: its parameters, gradients and process "
                             "groups are never freed")
    return CaseReport(reason="freed after the user dropped it")
