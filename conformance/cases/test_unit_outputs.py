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

Also: outputs that the loss leaves unused, and outputs in a namedtuple.
"""

from __future__ import annotations

from collections import namedtuple
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn as nn

from conformance.contract.adapter import Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import case, not_applicable
from conformance.contract.optional import full_grads, has_backward_hook
from fixtures.misc_models import PassThroughModel
from fixtures.models import (
    OUTPUT_USES,
    OutputUseModel,
    TwoOutputModel,
)
from fixtures.optimizers import make_optim
from fixtures.parity import (
    assert_close_named,
)
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

STEPS = 2


@case("unit_outputs/caller_use", world_size=2)
@pytest.mark.parametrize("use", list(OUTPUT_USES))
def test_caller_use(ctx: RankContext, impl: FSDPAdapter, use: str) -> None:
    """With the resharded ``head`` unit's output used through a view, in place, partly detached, or from a
    container or namedtuple, backward issues an all-gather, and full grads and params after each of two SGD
    steps match the local baseline (n/a where the adapter exposes no full grads)."""
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

@case("unit_outputs/not_all_outputs_used_in_loss", world_size=2, requires=[Capability.RESHARD_INTROSPECTION])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_not_all_outputs_used_in_loss(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
    """Loss uses (a, b) for 2 steps, then only a for 4 (the seed's 6): units reshard, SGD matches a local model."""
    local = TwoOutputModel(seed=0).to(ctx.device)
    model = TwoOutputModel(seed=0).to(ctx.device)
    spec = WrapSpec(strategy=strategy)
    model.lin1 = impl.wrap(model.lin1, spec)
    fsdp = impl.wrap(model, spec)
    assert_close_named(impl.full_params(fsdp), dict(local.named_parameters()), what="params after wrap")
    optim = torch.optim.SGD(fsdp.parameters(), lr=1e-3)
    local_optim = torch.optim.SGD(local.parameters(), lr=1e-3)
    inp = torch.ones(4, device=ctx.device)
    for step in range(6):
        before = {n: p.detach().clone() for n, p in local.named_parameters()}
        (a, b), (local_a, local_b) = fsdp(inp), local(inp)
        if step < 2:
            loss, local_loss = (a @ b).sum(), (local_a @ local_b).sum()
        else:
            loss, local_loss = a.sum(), local_a.sum()
        loss.backward()
        local_loss.backward()
        _assert_all_resharded(impl, fsdp, step)
        optim.step()
        local_optim.step()
        after = dict(local.named_parameters())
        assert any(not torch.equal(before[n], after[n]) for n in before), f"step {step}: SGD changed nothing"
        assert_close_named(impl.full_params(fsdp), after, what=f"params after step {step} on rank {ctx.rank}")
        optim.zero_grad()
        local_optim.zero_grad()
    ctx.barrier()


def _assert_all_resharded(impl: FSDPAdapter, model: nn.Module, step: int) -> None:
    units = impl.units(model)
    unknown = [u.fqn or "<root>" for u in units if u.resharded is None]
    assert not unknown, f"{impl.name} declares reshard_introspection but reports no resharded state for {unknown}"
    stale = [u.fqn or "<root>" for u in units if not u.resharded]
    assert not stale, f"step {step}: units not resharded after backward: {stale}"


_Quad = namedtuple("_Quad", ["a", "b", "c", "d"])


@case("unit_outputs/namedtuple_outputs", world_size=2)
def test_namedtuple_outputs(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A namedtuple passed through a unit comes back as the same namedtuple type, and every tensor field
    of it carries the implementation's backward hook."""
    model = impl.wrap(PassThroughModel(seed=0).to(ctx.device), WrapSpec())
    t = torch.ones(1, device=ctx.device, requires_grad=True)
    out = model(_Quad(t, t, t, t))
    assert isinstance(out, _Quad), f"namedtuple output came back as {type(out).__name__}"
    for name, field in zip(out._fields, out, strict=True):
        assert has_backward_hook(impl, field), f"rank {ctx.rank}: output field {name!r} has no backward hook"


