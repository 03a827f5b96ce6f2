"""unit_outputs: a unit's output used by the caller as callers do.

The ``head`` unit's output is used through views, modified in place after the
forward, detached in part, or taken out of a container; ``head`` is resharded
after its forward, so backward must gather its parameters again from hooks on
whatever the caller kept: backward must all-gather again (an implementation
whose autograd graph still holds the freed parameters may compute right
gradients without it, so the all-gather itself is checked). Each rank trains on its own batch; the baseline is
the local model over every rank's batch with the loss divided by the world
size ([Note: accumulation baseline] in ``test_grad_accumulation``). Full
gradients and, after each SGD-with-momentum step, parameters equal the
baseline's (torch's float32 tolerances).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from conformance.contract.adapter import FSDPAdapter, WrapSpec
from conformance.contract.case import case, not_applicable
from conformance.contract.optional import full_grads
from fixtures.models import OUTPUT_USES, OutputUseModel
from fixtures.optimizers import make_optim
from fixtures.parity import assert_close_named
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

STEPS = 2


@case("unit_outputs/caller_use", world_size=2)
@pytest.mark.parametrize("use", list(OUTPUT_USES))
def test_caller_use(ctx: RankContext, impl: FSDPAdapter, use: str) -> None:
    spec = WrapSpec(use_orig_params=True)
    inner = OutputUseModel(use, seed=0).to(ctx.device)
    inner.head = impl.wrap(inner.head, spec)  # type: ignore[assignment]
    model = impl.wrap(inner, spec)
    local = OutputUseModel(use, seed=0).to(ctx.device)
    optim, local_optim = make_optim("SGD", model.parameters()), make_optim("SGD", local.parameters())
    for step in range(STEPS):
        batches = [local.get_input(ctx.device, generator(rank_seed(step, r)))[0] for r in range(ctx.world_size)]
        loss = model(batches[ctx.rank]).square().sum()
        with ctx.record_collectives() as trace:
            loss.backward()
        gathers = [c for c in trace.calls if c.op.startswith("all_gather")]
        assert gathers, (
            f"rank {ctx.rank} step {step}: no all-gather in backward with the head output used as {use!r}; "
            f"head was resharded after forward, so its backward must gather it again\n{trace.render()}"
        )
        for batch in batches:
            (local(batch).square().sum() / ctx.world_size).backward()
        grads = full_grads(impl, model)
        if grads is None:
            not_applicable(f"{impl.name} cannot expose full gradients for this wrap")
            return
        want = {n: None if p.grad is None else p.grad.detach() for n, p in local.named_parameters()}
        assert_close_named(
            {n: None if g is None else g.to(ctx.device) for n, g in grads.items()}, want,
            what=f"rank {ctx.rank} step {step}: grads with the head output used as {use!r}",
        )
        for opt in (optim, local_optim):
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert_close_named(
            {n: p.to(ctx.device) for n, p in impl.full_params(model).items()},
            {n: p.detach() for n, p in local.named_parameters()},
            what=f"rank {ctx.rank}: params after step {step}",
        )
