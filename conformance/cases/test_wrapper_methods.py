"""wrapper_methods: FSDP1's methods on a wrapped model, against the unwrapped model.

Each row wraps :class:`fixtures.blocks.Blocks` with units the plan names and checks what torch 2.13's
``FullyShardedDataParallel`` docstrings promise, in values a user reads:

- ``apply[use_orig_params=...]``: ``apply(fn)`` "additionally gathers the full parameters before applying
  ``fn``" ("typical use includes initializing the parameters of a model"). ``fn`` fills every ``Linear``'s
  weight with values that depend on its full shape and position; afterwards the full parameters equal the
  local model's after ``nn.Module.apply(fn)``: ``fn`` saw each full parameter, and what it wrote was kept.
- ``check_is_root``: "Check if this instance is a root FSDP module": before the first forward and after a
  step, the wrapped model's answer is True and every nested unit's False.
- ``fsdp_modules[root_only=...]``: "Return all nested FSDP instances. This possibly includes ``module``
  itself and only includes FSDP root modules if ``root_only=True``": the user modules the returned units
  wrap are, by name, the root and the modules the wrap plan names (the root alone with ``root_only``), each
  once; the names come from the model as built, not from the adapter's own unit discovery.
- ``named_buffers``: inside ``summon_full_params`` the override "removes all occurrences of the
  FSDP-specific flattened buffer prefix": the names and values it yields equal the local model's, for
  buffers of the root and of nested units.
- ``comm_hook[strategy=...]``: ``register_comm_hook(state, hook)`` on the root before the first forward;
  "callables with signature 1 [``hook(state, grad)``] are expected to handle gradient communication for a
  ``NO_SHARD`` case", "with signature 2 [``hook(state, grad, output)``] for sharded cases", and FSDP reduces
  through the hook instead of itself. The hook sums over the ranks (all-reduce, or reduce-scatter into
  ``output``) and scales by ``3 / world size``: the gradients are three times the local model's mean over
  every rank's batch, and the parameters after an SGD step follow them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, DocCitation, case
from fixtures.blocks import Blocks, block_batch
from fixtures.parity import assert_close_named, named_grads
from fixtures.sharded_blocks import LR

if TYPE_CHECKING:
    from harness import RankContext

DOC = "torch.distributed.fsdp.FullyShardedDataParallel"
METHODS = [Capability.WRAPPER_METHODS]
#: What the comm hook multiplies the mean gradient by.
HOOK_SCALE = 3.0


def _wrapped(ctx: RankContext, impl: FSDPAdapter, units: tuple[str, ...] = ("b1", "b2", "b3"),
             **spec: Any) -> tuple[nn.Module, dict[str, nn.Module]]:
    """Blocks with the named submodules as units; the model and its modules by name as built."""
    plain = Blocks(seed=0).to(ctx.device)
    named = dict(plain.named_modules())
    plan = AutoWrap.submodules(plain, [named[name] for name in units])
    return impl.wrap(plain, WrapSpec(auto_wrap=plan, **spec)), named


def _fill(module: nn.Module) -> None:
    """A ``Linear``'s weight from its full shape (a piece of it would get other values), its bias a constant."""
    if isinstance(module, nn.Linear):
        with torch.no_grad():
            weight = module.weight
            weight.copy_(torch.arange(weight.numel(), dtype=weight.dtype).view(weight.shape) / weight.numel())
            module.bias.fill_(0.25)


@case("wrapper_methods/apply", clause=DocCitation(DOC, "apply"), world_size=TWO_OR_MORE, requires=METHODS)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_apply(ctx: RankContext, impl: FSDPAdapter, use_orig_params: bool) -> None:
    """``apply(fn)`` runs ``fn`` on full parameters and keeps what it wrote: the full parameters afterwards
    equal the local model's after ``nn.Module.apply(fn)``."""
    model, _ = _wrapped(ctx, impl, use_orig_params=use_orig_params)
    optional.apply_with_full_params(impl, model, _fill)
    local = Blocks(seed=0).to(ctx.device).apply(_fill)
    assert_close_named(impl.full_params(model), dict(local.named_parameters()),
                       what=f"rank {ctx.rank}: parameters after apply")


@case("wrapper_methods/check_is_root", clause=DocCitation(DOC, "check_is_root"), world_size=TWO_OR_MORE,
      requires=METHODS)
def test_check_is_root(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The wrapped model is a root and every nested unit is not, before the first forward and after a step."""
    model, _ = _wrapped(ctx, impl)
    _assert_one_root(ctx, impl, model, "before the first forward")
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    model(block_batch(0, ctx.rank, ctx.device)).sum().backward()
    optional.step(impl, model, optim)
    _assert_one_root(ctx, impl, model, "after a step")


def _assert_one_root(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, when: str) -> None:
    """``check_is_root`` on the wrapped model first (asked first, a unit becomes a root), then on each nested unit."""
    assert optional.check_is_root(impl, model) is True, f"rank {ctx.rank} {when}: the wrapped model says it is no root"
    nested = [unit for unit in impl.units(model) if unit.module is not model]
    assert len(nested) == 3, f"rank {ctx.rank} {when}: expected a unit per block, got {[u.fqn for u in nested]}"
    roots = [unit.fqn for unit in nested if optional.check_is_root(impl, unit.module)]
    assert not roots, f"rank {ctx.rank} {when}: nested units say they are roots: {roots}"


@case("wrapper_methods/fsdp_modules", clause=DocCitation(DOC, "fsdp_modules"), world_size=TWO_OR_MORE,
      requires=METHODS)
@pytest.mark.parametrize("root_only", [False, True])
def test_fsdp_modules(ctx: RankContext, impl: FSDPAdapter, root_only: bool) -> None:
    """The units returned wrap, by name as built, the root and the modules the plan names (the root alone with
    ``root_only``), each once."""
    model, named = _wrapped(ctx, impl, units=("b1", "b3"))
    found = optional.fsdp_modules(impl, model, root_only=root_only)
    names = {id(module): name for name, module in named.items()}
    wrapped = [names.get(id(optional.wrapped_module(impl, unit)), f"<{type(unit).__name__}>") for unit in found]
    expected = [""] if root_only else ["", "b1", "b3"]
    assert sorted(wrapped) == expected, (
        f"rank {ctx.rank}: fsdp_modules(root_only={root_only}) returned units wrapping {sorted(wrapped)} "
        f"(\"\": the root), expected {expected}")


def _with_buffers(model: Blocks) -> Blocks:
    model.register_buffer("steps", torch.tensor([7.0], device=model.head.weight.device))
    model.b1.register_buffer("scale", torch.arange(1.0, 4.0, device=model.head.weight.device))
    model.b3.up.register_buffer("shift", torch.full((2,), -0.5, device=model.head.weight.device))
    return model


@case("wrapper_methods/named_buffers", clause=DocCitation(DOC, "named_buffers"), world_size=TWO_OR_MORE,
      requires=METHODS)
def test_named_buffers(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Inside ``summon_full_params`` the model's ``named_buffers()`` gives the local model's names and values."""
    plain = _with_buffers(Blocks(seed=0).to(ctx.device))
    model = impl.wrap(plain, WrapSpec(auto_wrap=AutoWrap.submodules(plain, plain.blocks())))
    local = _with_buffers(Blocks(seed=0).to(ctx.device))
    buffers = optional.named_buffers(impl, model)
    names = [name for name, _ in buffers]
    assert len(set(names)) == len(names), f"rank {ctx.rank}: a buffer is yielded twice: {names}"
    assert_close_named(dict(buffers), dict(local.named_buffers()), what=f"rank {ctx.rank}: named_buffers()")


@dataclass
class _HookState:
    """The comm hook's state: the group it reduces over and what it multiplies the sum by."""

    group: dist.ProcessGroup | None
    factor: float


def _all_reduce_scaled(state: _HookState, grad: torch.Tensor) -> None:
    dist.all_reduce(grad, group=state.group)
    grad.mul_(state.factor)


def _reduce_scatter_scaled(state: _HookState, grad: torch.Tensor, output: torch.Tensor) -> None:
    dist.reduce_scatter_tensor(output, grad, group=state.group)
    output.mul_(state.factor)


@case("wrapper_methods/comm_hook", clause=DocCitation(DOC, "register_comm_hook"), world_size=TWO_OR_MORE,
      requires=METHODS)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_comm_hook(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
    """A hook summing over the ranks and scaling by ``3 / world size`` makes the gradients three times the
    local model's mean, and the parameters after a step follow them."""
    model, _ = _wrapped(ctx, impl, strategy=strategy, use_orig_params=True)
    group = impl.units(model)[0].shard_group
    hook = _all_reduce_scaled if strategy == "NO_SHARD" else _reduce_scatter_scaled
    optional.register_comm_hook(impl, model, _HookState(group, HOOK_SCALE / ctx.world_size), hook)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    model(block_batch(0, ctx.rank, ctx.device)).sum().backward()
    local = Blocks(seed=0).to(ctx.device)
    losses = [local(block_batch(0, rank, ctx.device)).sum() for rank in range(ctx.world_size)]
    (torch.stack(losses).sum() * HOOK_SCALE / ctx.world_size).backward()
    grads = optional.full_grads(impl, model)
    if grads is not None:
        assert_close_named(grads, named_grads(local), what=f"rank {ctx.rank}: grads through the hook")
    optional.step(impl, model, optim)
    torch.optim.SGD(local.parameters(), lr=LR).step()
    assert_close_named(impl.full_params(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")
