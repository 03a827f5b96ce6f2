"""grad_accumulation: several backwards before an optimizer step.

[Note: accumulation baseline]
Each rank runs ``BACKWARDS`` micro-batches of its own between optimizer steps.
FSDP averages a gradient over ranks, so after the micro-batches the full
gradient must equal the local model's gradient accumulated over every rank's
micro-batches with each loss divided by the world size (every rank can build
every rank's batches from the seeds). ``zero_grad`` after the step either sets
gradients to ``None`` or zeroes them in place; the next step must start from
nothing either way. Compared with torch's float32 tolerances (the reduction
sums in another order than the local backward).

[Note: accumulation without communication]
With ``no_sync=True`` every micro-batch but the last of each step runs inside
the implementation's ``no_sync`` (:func:`conformance.contract.optional.no_sync`:
FSDP1's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``). Those
backwards must issue no gradient collective (reduce-scatter or all-reduce; the
all-gathers are the parameters'), and the last backward must reduce what they
kept with its own: the gradients and parameters are compared with the same
local model as without it. That last backward is recorded too and must show a
gradient collective: an absence inside ``no_sync`` proves nothing if the
implementation's reductions cannot be seen at all (``Trace.require``). A kept gradient that outlives its step would show
in the second step's gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case, not_applicable
from conformance.contract.optional import NoSyncUnsupported, full_grads
from fixtures.models import ThreeLinear
from fixtures.optimizers import make_optim, wrapped_optim
from fixtures.parity import assert_close_named
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

BACKWARDS = 3
STEPS = 2
#: Collectives that reduce gradients, as the recorder names them (all-gathers carry parameters).
GRAD_COLLECTIVES = frozenset({"reduce_scatter_tensor", "reduce_scatter", "all_reduce"})


def _batch(ctx: RankContext, step: int, micro: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``micro`` of ``step`` (any rank can build any rank's)."""
    return ThreeLinear().get_input(ctx.device, generator(rank_seed(100 * step + micro, rank)))[0]


def _local_grads(local: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in local.named_parameters()}


def _check_cleared(ctx: RankContext, grads: Mapping[str, torch.Tensor | None], set_to_none: bool) -> None:
    """After ``zero_grad``: all ``None``, or all zeros (a ``None`` is fine where nothing was kept)."""
    if set_to_none:
        kept = [n for n, g in grads.items() if g is not None]
        assert not kept, f"rank {ctx.rank}: zero_grad(set_to_none=True) left grads on {kept}"
    else:
        nonzero = [n for n, g in grads.items() if g is not None and bool(g.count_nonzero())]
        assert not nonzero, f"rank {ctx.rank}: zero_grad(set_to_none=False) left nonzero grads on {nonzero}"


def _backward_without_sync(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, batch: torch.Tensor,
                           where: str) -> None:
    """One forward and backward inside ``impl``'s ``no_sync``; the backward must reduce no gradient."""
    try:
        context = optional.no_sync(impl, model)
    except NoSyncUnsupported as exc:
        not_applicable(str(exc))
    with context:
        loss = model(batch).sum()
        with ctx.record_collectives() as trace:
            loss.backward()
    reductions = [call for call in trace.calls if call.op in GRAD_COLLECTIVES]
    assert not reductions, (
        f"rank {ctx.rank} {where}: the backward inside no_sync issued {len(reductions)} gradient "
        f"collective(s):\n{trace.render()}"
    )


def _backward_with_sync(ctx: RankContext, model: nn.Module, batch: torch.Tensor, where: str) -> None:
    """The backward after ``no_sync`` must reduce: seeing it is what makes the absence inside meaningful."""
    loss = model(batch).sum()
    with ctx.record_collectives() as trace:
        loss.backward()
    trace.require(GRAD_COLLECTIVES, f"rank {ctx.rank} {where}: the backward after no_sync")


def _requires(params: Mapping[str, Any]) -> list[Capability]:
    wanted = {"cpu_offload": Capability.CPU_OFFLOAD, "no_sync": Capability.NO_SYNC}
    return [capability for param, capability in wanted.items() if params[param]]


@case("grad_accumulation/accumulate", clause="C3", world_size=TWO_OR_MORE, requires=_requires)
@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_accumulate(
    ctx: RankContext, impl: FSDPAdapter, cpu_offload: bool, set_to_none: bool, no_sync: bool
) -> None:
    """After ``BACKWARDS`` backwards per step the full grads equal the local model's accumulated over every
    rank's micro-batches (with ``no_sync``, all backwards but the last issue no gradient collective); after
    ``zero_grad`` grads are None or zero as asked, and params after each of ``STEPS`` SGD steps match."""
    model = impl.wrap(
        ThreeLinear(seed=0).to(ctx.device),
        WrapSpec(auto_wrap=AutoWrap((nn.Linear,)), use_orig_params=True, cpu_offload=cpu_offload),
    )
    local = ThreeLinear(seed=0).to(ctx.device)
    optim, local_optim = wrapped_optim(impl, model, "SGD"), make_optim("SGD", local.parameters())
    for step in range(STEPS):
        for micro in range(BACKWARDS):
            batch = _batch(ctx, step, micro, ctx.rank)
            if no_sync and micro < BACKWARDS - 1:
                _backward_without_sync(ctx, impl, model, batch, f"step {step} micro-batch {micro}")
            elif no_sync:
                _backward_with_sync(ctx, model, batch, f"step {step} micro-batch {micro}")
            else:
                model(batch).sum().backward()
            for rank in range(ctx.world_size):
                (local(_batch(ctx, step, micro, rank)).sum() / ctx.world_size).backward()
        grads = full_grads(impl, model)
        if grads is None:
            not_applicable(f"{impl.name} cannot expose full gradients for this wrap")
        assert_close_named(
            {n: None if g is None else g.to(ctx.device) for n, g in grads.items()}, _local_grads(local),
            what=f"rank {ctx.rank} step {step}: grads after {BACKWARDS} backwards vs the local model",
        )
        optional.step(impl, model, optim)
        local_optim.step()
        optim.zero_grad(set_to_none=set_to_none)
        local_optim.zero_grad(set_to_none=set_to_none)
        cleared = full_grads(impl, model)
        assert cleared is not None
        _check_cleared(ctx, cleared, set_to_none)
        assert_close_named(
            {n: p.to(ctx.device) for n, p in impl.full_params(model).items()},
            {n: p.detach() for n, p in local.named_parameters()},
            what=f"rank {ctx.rank}: params after step {step}",
        )
