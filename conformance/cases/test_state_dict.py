"""state_dict: model and optimizer state dicts, against a local model trained alike.

[Note: state dict baseline]
Every rank feeds the same batch, so the averaged gradient of a wrapped model
equals the gradient of the same model run locally; the baseline is that local
model with the same optimizer. A state dict is right when the model that
loaded it, and the optimizer that loaded its state, go on training exactly as
the baseline does (torch's float32 tolerances: reductions associate sums in
another order than one local backward).

Cases:

- ``roundtrip``: FULL or SHARDED model + optimizer state dicts saved after two
  Adam steps, loaded into a differently initialized model and optimizer: the
  parameters equal the baseline's and two more steps match it.
- ``load_in_loop``: a FULL model state dict loaded at a point of the training
  loop (between steps, after backward before the step, after a forward whose
  iteration is then abandoned) takes effect in the next forward; the gradient
  of the interrupted iteration is discarded (``zero_grad(set_to_none=True)``).
- ``cross_impl``: FULL model + optimizer state dicts saved by the row's
  implementation load into another (``dst``), and training continues like the
  baseline: the formats are the unwrapped module's names and shapes, so any
  implementation can read another's. torch-fsdp2's adapter saves and loads
  through ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional, registry
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.applicability import missing_reason
from conformance.contract.case import TWO_OR_MORE, case, not_applicable
from conformance.contract.exposures import parameter_exposures, under_exposure
from fixtures.models import ThreeLinear
from fixtures.parity import assert_close_named, assert_close_seq
from fixtures.seeding import generator

if TYPE_CHECKING:
    from harness import RankContext

LINEARS = AutoWrap((nn.Linear,))
IMPLS = ["reference", "torch-fsdp1", "torch-fsdp2"]


def _requires(params: Mapping[str, Any]) -> list[Capability]:
    sharded = params.get("kind") == "SHARDED"
    return [Capability.SHARDED_STATE_DICT if sharded else Capability.FULL_STATE_DICT, Capability.OPTIM_STATE_DICT]


def _wrap(ctx: RankContext, impl: FSDPAdapter, seed: int, use_orig_params: bool = True) -> nn.Module:
    return impl.wrap(
        ThreeLinear(seed=seed).to(ctx.device), WrapSpec(auto_wrap=LINEARS, use_orig_params=use_orig_params)
    )


def _batches(ctx: RankContext, count: int, seed: int) -> list[torch.Tensor]:
    """The same batches on every rank ([Note: state dict baseline])."""
    gen = generator(seed)
    return [ThreeLinear().get_input(ctx.device, gen)[0] for _ in range(count)]


def _train(impl: FSDPAdapter | None, model: nn.Module, optim: torch.optim.Optimizer,
           batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """A step per batch of ``model``, wrapped by ``impl`` (``None``: a plain local module); the losses."""
    losses = []
    for inp in batches:
        loss = model(inp).sum()
        loss.backward()
        if impl is None:
            optim.step()
        else:
            optional.step(impl, model, optim)
        optim.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def _assert_matches_local(
    ctx: RankContext, impl: FSDPAdapter, model: nn.Module, local: nn.Module, what: str
) -> None:
    assert_close_named(
        impl.full_params(model), {n: p.detach() for n, p in local.named_parameters()},
        what=f"rank {ctx.rank}: {what}",
    )


def _differs(impl: FSDPAdapter, model: nn.Module, local: nn.Module) -> bool:
    params = impl.full_params(model)
    return any(not torch.equal(params[n].cpu(), p.detach().cpu()) for n, p in local.named_parameters())


@case("state_dict/roundtrip", clause="C4", world_size=TWO_OR_MORE, requires=_requires)
@pytest.mark.parametrize("kind", ["FULL", "SHARDED"])
def test_roundtrip(ctx: RankContext, impl: FSDPAdapter, kind: str) -> None:
    """FULL or SHARDED model and optimizer state dicts saved after two Adam steps and loaded into a
    differently seeded model and optimizer give the local baseline's params, and the next two steps' losses
    and params match the baseline's (float32 tolerances)."""
    sharded = kind == "SHARDED"
    model, local = _wrap(ctx, impl, 0), ThreeLinear(seed=0).to(ctx.device)
    optim = optional.optimizer(impl, model, torch.optim.Adam, lr=1e-2)
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-2)
    batches = _batches(ctx, 4, seed=7)
    _train(impl, model, optim, batches[:2])
    _train(None, local, local_optim, batches[:2])
    model_state = impl.sharded_state_dict(model) if sharded else impl.full_state_dict(model)
    optim_state = impl.optim_state_dict(model, optim, sharded=sharded)

    fresh = _wrap(ctx, impl, 1)
    fresh_optim = optional.optimizer(impl, fresh, torch.optim.Adam, lr=1e-2)
    assert _differs(impl, fresh, local), "the fresh model already equals the trained one"
    impl.load_state_dict(fresh, model_state, sharded=sharded)
    impl.load_optim_state_dict(fresh, fresh_optim, optim_state, sharded=sharded)
    _assert_matches_local(ctx, impl, fresh, local, f"params after {kind} load")
    assert_close_seq(
        _train(impl, fresh, fresh_optim, batches[2:]), _train(None, local, local_optim, batches[2:]),
        what=f"rank {ctx.rank}: losses after {kind} load vs the local model",
    )
    _assert_matches_local(ctx, impl, fresh, local, f"params two steps after {kind} load")


@case("state_dict/load_in_loop", world_size=TWO_OR_MORE, requires=[Capability.FULL_STATE_DICT],
      uses=[Capability.FLAT_PARAM],
      clause="C4")
@pytest.mark.parametrize("point", ["between_steps", "after_backward", "after_forward"])
def test_load_in_loop(ctx: RankContext, impl: FSDPAdapter, point: str) -> None:
    """A FULL model state dict loaded between steps, after backward, or after an abandoned forward gives
    the loaded params, and the next forward's output and two steps' losses match the loaded model trained
    locally. ``lin2`` is its own unit, the root owns ``lin1`` and ``lin3``: after a forward the root may
    still hold its unsharded parameters, which the load must not leave stale. For every parameter exposure
    the implementation offers."""
    for use_orig_params in parameter_exposures(impl):
        with under_exposure(use_orig_params):
            _load_in_loop(ctx, impl, point, WrapSpec(use_orig_params=use_orig_params))


def _load_in_loop(ctx: RankContext, impl: FSDPAdapter, point: str, spec: WrapSpec) -> None:
    inner = ThreeLinear(seed=0).to(ctx.device)
    model = impl.wrap(inner, replace(spec, auto_wrap=AutoWrap(kind="module_names", module_names=("lin2",))))
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=1e-1)
    snapshot = ThreeLinear(seed=1).to(ctx.device)
    state = {k: v.detach().clone() for k, v in snapshot.state_dict().items()}
    batches = _batches(ctx, 4, seed=11)
    _train(impl, model, optim, batches[:1])
    loss = model(batches[1]).sum()
    if point == "after_forward":
        # The iteration is abandoned: a plain module's backward would fail on the
        # parameters the load modified in place, so no backward follows.
        del loss
        impl.load_state_dict(model, state, sharded=False)
    else:
        loss.backward()
    if point == "after_backward":
        impl.load_state_dict(model, state, sharded=False)
    if point == "between_steps":
        optional.step(impl, model, optim)
        impl.load_state_dict(model, state, sharded=False)
    optim.zero_grad(set_to_none=True)  # the interrupted iteration's gradient is discarded
    _assert_matches_local(ctx, impl, model, snapshot, f"params after loading {point}")
    with torch.no_grad():
        assert_close_seq(
            [model(batches[2])], [snapshot(batches[2])],
            what=f"rank {ctx.rank}: first forward after loading {point} vs the loaded model",
        )
    snapshot_optim = torch.optim.SGD(snapshot.parameters(), lr=1e-1)
    assert_close_seq(
        _train(impl, model, optim, batches[2:]), _train(None, snapshot, snapshot_optim, batches[2:]),
        what=f"rank {ctx.rank}: losses after loading {point} vs the loaded model trained locally",
    )


def _cross_requires(params: Mapping[str, Any]) -> list[Capability]:
    return _requires({**params, "kind": "FULL"})


@case("state_dict/cross_impl", clause=("C4", "C5"), world_size=TWO_OR_MORE, requires=_cross_requires)
@pytest.mark.parametrize("dst", IMPLS)
def test_cross_impl(ctx: RankContext, impl: FSDPAdapter, dst: str) -> None:
    """Saved by the row's implementation, loaded by ``dst``, trained on like the local model.

    The row's implementation is the saver, so a FAIL in its column says its
    checkpoint is not what the others read (the loaders are checked in their
    own rows' ``roundtrip``).
    """
    loader_impl = registry.load(dst)
    reason = loader_impl.unavailable_reason()
    if reason is not None:
        not_applicable(f"loading implementation {dst} unavailable: {reason}")
    lacking = missing_reason(loader_impl, _cross_requires({}), ctx.mode)
    if lacking is not None:
        not_applicable(f"loading implementation: {lacking}")
    saver, local = _wrap(ctx, impl, 0), ThreeLinear(seed=0).to(ctx.device)
    saver_optim = optional.optimizer(impl, saver, torch.optim.Adam, lr=1e-2)
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-2)
    batches = _batches(ctx, 4, seed=13)
    _train(impl, saver, saver_optim, batches[:2])
    _train(None, local, local_optim, batches[:2])
    model_state = impl.full_state_dict(saver)
    optim_state = impl.optim_state_dict(saver, saver_optim, sharded=False)

    loader = _wrap(ctx, loader_impl, 1)
    loader_optim = optional.optimizer(loader_impl, loader, torch.optim.Adam, lr=1e-2)
    loader_impl.load_state_dict(loader, model_state, sharded=False)
    loader_impl.load_optim_state_dict(loader, loader_optim, optim_state, sharded=False)
    _assert_matches_local(ctx, loader_impl, loader, local, f"params saved by {impl.name}, loaded by {dst}")
    assert_close_seq(
        _train(loader_impl, loader, loader_optim, batches[2:]), _train(None, local, local_optim, batches[2:]),
        what=f"rank {ctx.rank}: losses after {impl.name} -> {dst} vs the local model",
    )
