"""param_kinds: frozen, ignored and shared parameters in each position a ``fully_shard`` unit can hold them,
and FSDP1's ``ignored_states``.

The model is :class:`fixtures.blocks.Blocks` (three block units, the root keeps ``head``), trained
three SGD steps against a local copy given the mean of every rank's loss.

- ``frozen[position=whole_unit|mixed_in_unit|root]``: ``b2`` entirely, only ``b2.up.weight``, or
  the root's ``head.weight`` have ``requires_grad=False``. Frozen parameters get no gradient and
  keep their values; every parameter ends equal to the local model's.
- ``ignored``: ``b2``'s parameters are passed as ``ignored_params``: they stay whole, plain tensors
  on every rank and their gradient after a backward is this rank's own (not averaged), while every
  other gradient is the mean over ranks.
- ``shared[position=within_unit|across_units]``: one parameter used twice, by ``b2.up`` and
  ``b2.down`` (one unit), or by the root's ``head`` and ``b2.up`` (two units). Within a unit it
  trains like the local model. Across units an implementation either trains like the local model
  too or refuses with an exception before the first step ends (torch's FSDP2 refuses: a parameter
  belongs to one unit); it never trains on silently different values.
- ``ignored_states[kind=parameters|modules]``: FSDP1's wrapper, ``b1`` and ``b3`` its units, given
  ``ignored_states`` of ``b2``'s parameters, or of ``b2`` itself. Torch 2.13's docstring: "Ignored
  parameters or modules that will not be managed by this FSDP instance, meaning that the parameters are
  not sharded and their gradients are not reduced across ranks". ``b2``'s parameters stay the very
  parameters the model was built with, whole; after a backward on each rank's own batch their gradient
  is this rank's own; after an SGD step they equal a local model's stepped on this rank's batch alone,
  and every other parameter the local model's stepped on the mean over ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.results import CaseReport
from fixtures.blocks import Blocks, block_batch
from fixtures.parity import assert_close_named
from fixtures.sharded_blocks import LR, full_of, local_step, mesh_over, shard_blocks, sharded_step

if TYPE_CHECKING:
    from harness import RankContext

REQUIRES = [Capability.FULLY_SHARD]
STEPS = 3


def _frozen(model: Blocks, position: str) -> list[nn.Parameter]:
    """Freeze the parameters at ``position``; return them."""
    params = {
        "whole_unit": list(model.b2.parameters()),
        "mixed_in_unit": [model.b2.up.weight],
        "root": [model.head.weight],
    }[position]
    for param in params:
        param.requires_grad_(False)
    return params


def _optims(impl: FSDPAdapter, model: nn.Module,
            local: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return (optional.optimizer(impl, model, torch.optim.SGD, lr=LR, momentum=0.9),
            torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9))


def _train_alike(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, local: nn.Module, first: int = 0,
                 optims: tuple[torch.optim.Optimizer, torch.optim.Optimizer] | None = None) -> None:
    """Steps ``first`` to ``STEPS - 1`` on both, then their parameters compared."""
    optim, local_optim = optims or _optims(impl, model, local)
    for step in range(first, STEPS):
        sharded_step(ctx, impl, model, optim, step)
        local_step(ctx, local, local_optim, step, range(ctx.world_size))
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


@case("param_kinds/frozen", clause="C18", world_size=TWO_OR_MORE, requires=REQUIRES)
@pytest.mark.parametrize("position", ["whole_unit", "mixed_in_unit", "root"])
def test_frozen(ctx: RankContext, impl: FSDPAdapter, position: str) -> None:
    """Frozen parameters (a whole unit, part of a unit, or the root's) get no gradient and keep their
    values; every parameter ends equal to the local model's."""
    local = Blocks(seed=0).to(ctx.device)
    _frozen(local, position)
    plain = Blocks(seed=0).to(ctx.device)
    frozen_names = {name for name, p in plain.named_parameters() if any(p is f for f in _frozen(plain, position))}
    model = shard_blocks(impl, plain, mesh_over(ctx))
    before = {name: value for name, value in full_of(model).items() if name in frozen_names}
    _train_alike(ctx, impl, model, local)
    params = dict(model.named_parameters())
    for name in sorted(frozen_names):
        assert not params[name].requires_grad, f"rank {ctx.rank}: frozen {name} requires grad after sharding"
        assert params[name].grad is None, f"rank {ctx.rank}: frozen {name} has a gradient"
    after = {name: value for name, value in full_of(model).items() if name in frozen_names}
    assert_close_named(after, before, what=f"rank {ctx.rank}: frozen parameters after training",
                       exact="frozen parameters are never written")


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        out[name] = None if grad is None else (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return out


@case("param_kinds/ignored", clause="C18", world_size=TWO_OR_MORE, requires=REQUIRES + [Capability.IGNORED_MODULES])
def test_ignored(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Ignored parameters stay whole plain tensors whose gradient is this rank's own, while every other
    gradient is the mean over ranks."""
    plain = Blocks(seed=0).to(ctx.device)
    ignored = list(plain.b2.parameters())
    ignored_names = {name for name, p in plain.named_parameters() if any(p is i for i in ignored)}
    model = shard_blocks(impl, plain, mesh_over(ctx), ignored_params=ignored)
    for name, param in model.named_parameters():
        if name in ignored_names:
            assert not hasattr(param, "full_tensor") and param.shape == Blocks(seed=0).get_parameter(name).shape, (
                f"rank {ctx.rank}: ignored {name} is not a whole plain tensor: {type(param).__name__} {param.shape}"
            )
    model(block_batch(0, ctx.rank, ctx.device)).sum().backward()
    own, mean = Blocks(seed=0).to(ctx.device), Blocks(seed=0).to(ctx.device)
    own(block_batch(0, ctx.rank, ctx.device)).sum().backward()
    (sum(mean(block_batch(0, r, ctx.device)).sum() for r in range(ctx.world_size)) / ctx.world_size).backward()
    expected = {name: (own if name in ignored_names else mean).get_parameter(name).grad for name in _grads(mean)}
    assert_close_named(_grads(model), expected, what=f"rank {ctx.rank}: gradients (ignored: this rank's own)")


def _share(model: Blocks, position: str) -> None:
    if position == "within_unit":
        model.b2.down.weight = model.b2.up.weight
    else:
        model.head.weight = model.b2.up.weight


@case("param_kinds/shared", clause="C18", world_size=TWO_OR_MORE, requires=REQUIRES)
@pytest.mark.parametrize("position", ["within_unit", "across_units"])
def test_shared(ctx: RankContext, impl: FSDPAdapter, position: str) -> CaseReport:
    """A parameter used twice within a unit trains like the local model; across units the implementation
    trains like the local model or refuses before the first step ends, never trains on other values."""
    local, plain = Blocks(seed=0).to(ctx.device), Blocks(seed=0).to(ctx.device)
    _share(local, position)
    _share(plain, position)
    try:
        model = shard_blocks(impl, plain, mesh_over(ctx))
        optims = _optims(impl, model, local)
        sharded_step(ctx, impl, model, optims[0], 0)
    except Exception as exc:  # noqa: BLE001 - any refusal is allowed across units, and reported
        refused = f"{type(exc).__name__}: {exc}"
        assert position == "across_units", f"rank {ctx.rank}: a parameter shared within a unit raised {refused}"
        assert ctx.all_ranks_equal(True), f"rank {ctx.rank} refused ({refused}) but another rank did not"
        return CaseReport(reason=f"refused: {refused[:200]}")
    assert ctx.all_ranks_equal(False), f"rank {ctx.rank} trained but another rank refused"
    local_step(ctx, local, optims[1], 0, range(ctx.world_size))
    _train_alike(ctx, impl, model, local, first=1, optims=optims)
    return CaseReport(reason="trained like the local model")


@case("param_kinds/ignored_states", clause="C18", world_size=TWO_OR_MORE, requires=[Capability.IGNORED_STATES])
@pytest.mark.parametrize("kind", ["parameters", "modules"])
def test_ignored_states(ctx: RankContext, impl: FSDPAdapter, kind: str) -> None:
    """``b2``'s parameters, ignored as parameters or through their module, stay the same whole parameters
    and train on this rank's own gradient; every other parameter trains on the mean over ranks."""
    plain = Blocks(seed=0).to(ctx.device)
    ignored = dict(plain.b2.named_parameters(prefix="b2"))
    states: list[nn.Parameter] | list[nn.Module] = list(ignored.values()) if kind == "parameters" else [plain.b2]
    plan = AutoWrap.submodules(plain, [plain.b1, plain.b3])
    model = impl.wrap(plain, WrapSpec(ignored_states=states, auto_wrap=plan))
    for name, param in ignored.items():
        held = plain.get_parameter(name)
        assert held is param and held.shape == Blocks(seed=0).get_parameter(name).shape, (
            f"rank {ctx.rank}: ignored {name} is no longer the whole parameter built: {tuple(held.shape)}")
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    model(block_batch(0, ctx.rank, ctx.device)).sum().backward()
    own, mean = Blocks(seed=0).to(ctx.device), Blocks(seed=0).to(ctx.device)
    own(block_batch(0, ctx.rank, ctx.device)).sum().backward()
    (sum(mean(block_batch(0, r, ctx.device)).sum() for r in range(ctx.world_size)) / ctx.world_size).backward()
    assert_close_named({name: p.grad for name, p in ignored.items()},
                       {name: own.get_parameter(name).grad for name in ignored},
                       what=f"rank {ctx.rank}: ignored gradients (this rank's own)")
    optional.step(impl, model, optim)
    for local in (own, mean):
        torch.optim.SGD(local.parameters(), lr=LR).step()
    expected = {name: (own if name in ignored else mean).get_parameter(name) for name, _ in mean.named_parameters()}
    assert_close_named(impl.full_params(model), expected, what=f"rank {ctx.rank}: parameters after a step")
