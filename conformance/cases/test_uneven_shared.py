"""uneven_shared: parameter counts that do not divide by the world size, units smaller
than the world, and tied weights within and across units.

[Note: uneven baseline]
:class:`fixtures.models.UnevenTiedModel` has 29 root parameters, a one-element
unit and an embedding tied to the output projection. Each rank trains on its
own batch; the local baseline runs every rank's batch with the loss divided by
the world size, so the averaged gradients are equal ([Note: accumulation
baseline] in ``test_grad_accumulation``). After every SGD-with-momentum step
the full parameters, which are every rank's rows put together (padding ranks'
included), must equal the baseline's, and the tie must hold.

A weight tied across units (``proj`` a unit of its own, ``embed`` in the root)
may be refused with a ValueError that says "shared" and names it (shared
parameters must then be wrapped in a common unit), at wrap time or at the first
forward, before anything trained: torch's FSDP2 checks its groups for a shared
parameter in its lazy initialization, which the root's first forward runs. An
implementation that runs the first forward must train the weight as one
parameter, like the baseline; an error at a later step, or training that
unties it, FAILs.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.exposures import parameter_exposures, under_exposure
from conformance.contract.results import CaseReport
from fixtures.models import UnevenTiedModel
from fixtures.optimizers import make_optim, wrapped_optim
from fixtures.parity import assert_close_named, assert_close_seq
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

STEPS = 3
#: A rejection must name one of the tied parameters.
SHARED_NAMES = r"embed\.weight|proj\.weight"


def _wrap(ctx: RankContext, impl: FSDPAdapter, tie: str, spec: WrapSpec) -> nn.Module:
    """``tiny`` is its own unit; so is ``proj`` when the tie crosses units."""
    model = UnevenTiedModel(seed=0).to(ctx.device)
    units = ("tiny", "proj") if tie == "across_units" else ("tiny",)
    return impl.wrap(model, replace(spec, auto_wrap=AutoWrap(kind="module_names", module_names=units)))


@case("uneven_shared/train", clause=("C1", "C18"), world_size=TWO_OR_MORE, uses=[Capability.FLAT_PARAM])
@pytest.mark.parametrize("tie", ["within_unit", "across_units"])
def test_train(ctx: RankContext, impl: FSDPAdapter, tie: str) -> CaseReport | None:
    """Uneven shards, a one-element unit and a tied embedding/projection: params after wrap, each rank's
    loss and params after each of three SGD steps match the local baseline, and the tie holds. A tie across
    units may instead be refused, at wrap or at the first forward, with a ValueError saying "shared" and
    naming a tied weight. For every parameter exposure the implementation offers."""
    rejected = []
    for use_orig_params in parameter_exposures(impl):
        with under_exposure(use_orig_params):
            rejection = _train_against_local(ctx, impl, tie, WrapSpec(use_orig_params=use_orig_params))
        if rejection is not None:
            rejected.append(f"use_orig_params={use_orig_params}: {rejection}")
    return CaseReport(reason="; ".join(rejected)) if rejected else None


def _refusal(exc: ValueError, tie: str) -> str:
    """``exc``'s text if it is the refusal of a tie across units the case accepts; else re-raise it."""
    if tie != "across_units" or "shared" not in str(exc) or not re.search(SHARED_NAMES, str(exc)):
        raise exc
    return str(exc)


def _train_against_local(ctx: RankContext, impl: FSDPAdapter, tie: str, spec: WrapSpec) -> str | None:
    """The row's checks under one exposure; where the tie was refused (at wrap or at the first forward),
    and the refusal's text. The parameters after wrap are compared after the first backward, before the
    first step changes them, so that a refusal at the first forward comes first."""
    try:
        model = _wrap(ctx, impl, tie, spec)
    except ValueError as exc:
        return f"refused at wrap: {_refusal(exc, tie)}"
    local = UnevenTiedModel(seed=0).to(ctx.device)
    optim, local_optim = wrapped_optim(impl, model, "SGD"), make_optim("SGD", local.parameters())
    want = {n: p.detach().clone() for n, p in local.named_parameters()}
    for step in range(STEPS):
        batches = [local.get_input(ctx.device, generator(rank_seed(step, r)))[0] for r in range(ctx.world_size)]
        try:
            loss = model(batches[ctx.rank]).square().mean()
        except ValueError as exc:
            if step > 0:
                raise
            return f"refused at the first forward: {_refusal(exc, tie)}"
        loss.backward()
        if step == 0:
            assert_close_named(impl.full_params(model), want, what=f"rank {ctx.rank}: params after wrap")
        local_losses = [local(b).square().mean() for b in batches]
        (sum(local_losses) / ctx.world_size).backward()  # type: ignore[operator]
        assert_close_seq([loss.detach()], [local_losses[ctx.rank].detach()], what=f"rank {ctx.rank} step {step}: loss")
        optional.step(impl, model, optim)
        local_optim.step()
        for opt in (optim, local_optim):
            opt.zero_grad(set_to_none=True)
        params = impl.full_params(model)
        assert_close_named(params, {n: p.detach() for n, p in local.named_parameters()},
                           what=f"rank {ctx.rank}: params after step {step}")
        assert "proj.weight" not in params or torch.equal(params["proj.weight"], params["embed.weight"]), (
            f"rank {ctx.rank} step {step}: the tied proj.weight and embed.weight differ"
        )
    return None
