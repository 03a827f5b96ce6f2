"""unit_outputs: a unit's output used by the caller as callers do.

The ``head`` unit's output is used through views, modified in place after the
forward, detached in part, or taken out of a container; ``head`` is resharded
after its forward, so its backward must gather its parameters again, whatever
the caller did with the output (an implementation whose autograd graph still
holds the freed parameters computes right gradients without it, so at least one
all-gather in backward is checked). Each rank trains on its own batch; the baseline is
the local model over every rank's batch with the loss divided by the world
size ([Note: accumulation baseline] in ``test_grad_accumulation``). Full
gradients and, after each SGD-with-momentum step, parameters equal the
baseline's (torch's float32 tolerances).

Also: a root holding no parameter of its own whose two outputs, each from a unit, both reach the loss, so its
backward starts from each (torch's FSDP1 queues its end-of-backward callback once, on the first; found as the
worklist of a torch mutant, docs/PERFORMANCE.md), trained against the local model the same way; outputs returned
in any structure (namedtuple, dict, list, dataclass,
nested containers), trained against the local model the same way; and outputs
that the loss leaves unused, trained against a local model, with, for an
implementation that reports it, every unit resharded after each backward
(a separate row: it needs ``Capability.RESHARD_INTROSPECTION``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case, not_applicable
from conformance.contract.optional import full_grads
from fixtures.misc_models import OUTPUT_STRUCTURES, StructuredOutputModel
from fixtures.models import (
    OUTPUT_USES,
    OutputUseModel,
    TwoOutputModel,
)
from fixtures.optimizers import make_optim, wrapped_optim
from fixtures.parity import (
    assert_close_named,
)
from fixtures.seeding import generator, rank_seed, seeded_init_

if TYPE_CHECKING:
    from harness import RankContext

STEPS = 2
#: ``head`` its own unit under the root.
HEAD_UNIT = AutoWrap(kind="module_names", module_names=("head",))
#: ``lin1`` its own unit under the root.
LIN1_UNIT = AutoWrap(kind="module_names", module_names=("lin1",))


def _step_vs_local(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, local: Any,
                   optims: tuple[torch.optim.Optimizer, torch.optim.Optimizer], step: int, label: str,
                   on_backward: Callable[[Any], None] | None = None) -> None:
    """One SGD step of ``model`` on this rank's batch and of ``local`` on every rank's (the loss divided
    by the world size, [Note: accumulation baseline]); full grads after backward and params after the step
    must match (n/a without full grads). ``on_backward`` gets the recorded collectives of the backward, after
    :func:`_head_resharded` checked the state it relies on."""
    batches = [local.get_input(ctx.device, generator(rank_seed(step, r)))[0] for r in range(ctx.world_size)]
    loss = model(batches[ctx.rank]).square().sum()
    _head_resharded(impl, model, f"rank {ctx.rank} step {step} with {label}")
    with ctx.record_collectives() as trace:
        loss.backward()
    if on_backward is not None:
        on_backward(trace)
    for batch in batches:
        (local(batch).square().sum() / ctx.world_size).backward()
    grads = full_grads(impl, model)
    if grads is None:
        not_applicable(f"{impl.name} cannot expose full gradients for this wrap")
        return
    want = {n: None if p.grad is None else p.grad.detach() for n, p in local.named_parameters()}
    assert_close_named({n: None if g is None else g.to(ctx.device) for n, g in grads.items()}, want,
                       what=f"rank {ctx.rank} step {step}: grads with {label}")
    optional.step(impl, model, optims[0])
    optims[1].step()
    for opt in optims:
        opt.zero_grad(set_to_none=True)
    assert_close_named({n: p.to(ctx.device) for n, p in impl.full_params(model).items()},
                       {n: p.detach() for n, p in local.named_parameters()},
                       what=f"rank {ctx.rank}: params after step {step} with {label}")


def _head_resharded(impl: FSDPAdapter, model: nn.Module, label: str) -> None:
    """After forward, ``head``'s unit reports itself resharded where the adapter reports it (``resharded`` not
    None): the state :func:`_regathered` relies on is observed, not inferred from an all-gather that a
    prefetch could have issued for a unit still gathered."""
    kept = [u.fqn for u in impl.units(model) if u.fqn.split(".")[0] == "head" and u.resharded is False]
    assert not kept, f"{label}: after forward, units {kept} still hold their unsharded parameters"


def _regathered(ctx: RankContext, step: int, label: str) -> Callable[[Any], None]:
    """A check of the backward's collectives: at least one all-gather, of any size and group (one per unit
    or one per parameter alike). ``head``'s parameters were freed after forward, so its backward must
    gather them again; right gradients alone do not show it (see the module docstring)."""

    def check(trace: Any) -> None:
        assert any(c.op.startswith("all_gather") for c in trace.calls), (
            f"rank {ctx.rank} step {step}: no all-gather in backward with {label}; head was resharded after "
            f"forward, so its backward must gather it again\n{trace.render()}"
        )

    return check


@case("unit_outputs/caller_use", clause=("C20", "C2"), world_size=TWO_OR_MORE)
@pytest.mark.parametrize("use", list(OUTPUT_USES))
def test_caller_use(ctx: RankContext, impl: FSDPAdapter, use: str) -> None:
    """With the resharded ``head`` unit's output used through a view, in place, partly detached, or from a
    container or namedtuple, backward issues an all-gather, and full grads and params after each of two SGD
    steps match the local baseline (n/a where the adapter exposes no full grads)."""
    spec = WrapSpec(use_orig_params=True, auto_wrap=HEAD_UNIT)
    inner = OutputUseModel(use, seed=0).to(ctx.device)
    model = impl.wrap(inner, spec)
    local = OutputUseModel(use, seed=0).to(ctx.device)
    optims = (wrapped_optim(impl, model, "SGD"), make_optim("SGD", local.parameters()))
    label = f"the head output used as {use!r}"
    for step in range(STEPS):
        _step_vs_local(ctx, impl, model, local, optims, step, label, _regathered(ctx, step, label))


@case("unit_outputs/structured_outputs", clause=("C20", "C2"), world_size=TWO_OR_MORE)
@pytest.mark.parametrize("structure", list(OUTPUT_STRUCTURES))
def test_structured_outputs(ctx: RankContext, impl: FSDPAdapter, structure: str) -> None:
    """A unit (``head``, resharded after forward) returning its two outputs in a namedtuple, dict, list,
    dataclass or nested containers: the caller gets the same structure (the same type) back, backward
    all-gathers again, and full grads and params after each of two SGD steps match the local model's (n/a
    without full grads)."""
    spec = WrapSpec(use_orig_params=True, auto_wrap=HEAD_UNIT)
    inner = StructuredOutputModel(structure, seed=0).to(ctx.device)
    model = impl.wrap(inner, spec)
    local = StructuredOutputModel(structure, seed=0).to(ctx.device)
    optims = (wrapped_optim(impl, model, "SGD"), make_optim("SGD", local.parameters()))
    label = f"head's outputs in a {structure}"
    for step in range(STEPS):
        _step_vs_local(ctx, impl, model, local, optims, step, label, _regathered(ctx, step, label))
        assert set(inner.head_types) == set(local.head_types), (
            f"rank {ctx.rank} step {step}: the wrapped head returned {sorted(t.__name__ for t in inner.head_types)}, "
            f"the local head {sorted(t.__name__ for t in local.head_types)}"
        )


def _train_two_outputs(ctx: RankContext, impl: FSDPAdapter, strategy: str,
                       after_backward: Callable[[nn.Module, int], None] | None = None,
                       in_lin1: Callable[[nn.Module], None] | None = None) -> None:
    """The seed's loop: outputs (a, b), loss over both for 2 steps then over a only for 4; SGD on the
    wrapped model and a local one, full params compared after every step; ``after_backward(model, step)``
    runs after each backward, ``in_lin1(model)`` right after each forward of the user's ``lin1`` (a forward
    hook run before any other)."""
    local = TwoOutputModel(seed=0).to(ctx.device)
    model = TwoOutputModel(seed=0).to(ctx.device)
    lin1 = model.lin1
    fsdp = impl.wrap(model, WrapSpec(strategy=strategy, auto_wrap=LIN1_UNIT))
    if in_lin1 is not None:
        lin1.register_forward_hook(lambda *_: in_lin1(fsdp), prepend=True)
    assert_close_named(impl.full_params(fsdp), dict(local.named_parameters()), what="params after wrap")
    optim = optional.optimizer(impl, fsdp, torch.optim.SGD, lr=1e-3)
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
        if after_backward is not None:
            after_backward(fsdp, step)
        optional.step(impl, fsdp, optim)
        local_optim.step()
        after = dict(local.named_parameters())
        assert any(not torch.equal(before[n], after[n]) for n in before), f"step {step}: SGD changed nothing"
        assert_close_named(impl.full_params(fsdp), after, what=f"params after step {step} on rank {ctx.rank}")
        optim.zero_grad()
        local_optim.zero_grad()
    ctx.barrier()


@case("unit_outputs/not_all_outputs_used_in_loss", clause=("C20", "C2"), world_size=TWO_OR_MORE)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_not_all_outputs_used_in_loss(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
    """Loss uses (a, b) for 2 steps, then only a for 4 (the seed's 6): after every SGD step the full
    params equal a local model's."""
    _train_two_outputs(ctx, impl, strategy)


@case("unit_outputs/unused_outputs_resharded", world_size=TWO_OR_MORE, requires=[Capability.RESHARD_INTROSPECTION],
      clause=("C20", "C11"))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_unused_outputs_resharded(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
    """The training of ``not_all_outputs_used_in_loss``; after every backward each unit reports itself
    resharded, the one whose output the loss left unused too. The flag is seen to change: under a sharding
    strategy, ``lin1``'s unit reports itself not resharded while ``lin1``'s forward runs (its parameters are
    gathered then), so a constant flag fails."""

    def all_resharded(model: nn.Module, step: int) -> None:
        units = impl.units(model)
        unknown = [u.fqn or "<root>" for u in units if u.resharded is None]
        assert not unknown, f"{impl.name} declares reshard_introspection but reports no resharded state for {unknown}"
        stale = [u.fqn or "<root>" for u in units if not u.resharded]
        assert not stale, f"step {step}: units not resharded after backward: {stale}"

    def gathered(model: nn.Module) -> None:
        states = {u.fqn: u.resharded for u in impl.units(model) if u.fqn == "lin1"}
        assert states == {"lin1": False}, f"while lin1's forward runs, its unit reports resharded {states}"

    _train_two_outputs(ctx, impl, strategy, all_resharded, None if strategy == "NO_SHARD" else gathered)


class _TwoOutputRoot(nn.Module):
    """A root without parameters of its own returning two tensors, each from a unit: ``a(x)`` and
    ``b(tanh(a(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        seeded_init_(self, 0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.a(x)
        return first, self.b(torch.tanh(first))


@case("unit_outputs/root_outputs", clause=("C20", "C2"), world_size=TWO_OR_MORE)
def test_root_outputs(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A root holding no parameter of its own (each ``Linear`` its own unit) whose two outputs both reach the
    loss, so the root's backward starts from each of them: over two SGD steps the full gradients after backward
    and then the parameters equal the local model's (stepped on the mean of every rank's loss)."""
    plain = _TwoOutputRoot().to(ctx.device)
    model = impl.wrap(plain, WrapSpec(use_orig_params=True, auto_wrap=AutoWrap.submodules(plain, [plain.a, plain.b])))
    local = _TwoOutputRoot().to(ctx.device)
    optims = (wrapped_optim(impl, model, "SGD"), make_optim("SGD", local.parameters()))
    for step in range(STEPS):
        batches = [torch.randn(2, 4, generator=generator(rank_seed(step, r))).to(ctx.device)
                   for r in range(ctx.world_size)]
        sum(out.square().sum() for out in model(batches[ctx.rank])).backward()
        for batch in batches:
            (sum(out.square().sum() for out in local(batch)) / ctx.world_size).backward()
        grads = full_grads(impl, model)
        if grads is None:
            not_applicable(f"{impl.name} cannot expose full gradients for this wrap")
        assert_close_named({n: None if g is None else g.to(ctx.device) for n, g in grads.items()},
                           {n: p.grad for n, p in local.named_parameters()}, what=f"rank {ctx.rank} step {step}: grads")
        optional.step(impl, model, optims[0])
        optims[1].step()
        for optim in optims:
            optim.zero_grad(set_to_none=True)
        assert_close_named(impl.full_params(model), dict(local.named_parameters()),
                           what=f"rank {ctx.rank}: params after step {step}")
