"""misc: training behaviour, wrap-time warnings and construction contracts.

Rows of the ``misc / device placement`` table that are about what happens in
forward/backward/optimizer steps or at wrap time on the CPU. The device
placement rows live in ``test_misc_device.py``; helpers and the note on CPU
groups in ``_misc_helpers.py`` ([Note: misc device placement]).
"""

from __future__ import annotations

import copy
import re
from collections import namedtuple
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from conformance.cases._misc_helpers import cpu_world_group, env_on_all_ranks, hybrid_cpu_groups
from conformance.contract.adapter import HYBRID_STRATEGIES, STRATEGIES, AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import case
from conformance.contract.optional import has_backward_hook
from fixtures.misc_models import PassThroughModel, RankInitModel
from fixtures.models import (
    MLP,
    NestedModel,
    OptionalSecondOutputModel,
    SetattrLinear,
    SumOfInputsModel,
    TwoOutputModel,
)
from fixtures.optimizers import OPTIMIZERS, make_optim
from fixtures.parity import (
    assert_close_named,
    assert_differs_across_ranks,
    assert_runs_match,
    assert_same_across_ranks,
    run_steps,
)
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

ALWAYS = AutoWrap(kind="always")
CPU = torch.device("cpu")


def _sum_loss(output: Any, _batch: tuple[Any, ...]) -> torch.Tensor:
    return output.sum()


def _pg_tuple_for_hybrid(params: Mapping[str, Any]) -> list[Capability]:
    return [Capability.HYBRID_VIA_PG_TUPLE] if params["strategy"] in HYBRID_STRATEGIES else []


@case("misc/cpu_training_parity_vs_ddp", world_size=4, timeout_s=180.0, requires=_pg_tuple_for_hybrid)
@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_cpu_training_parity_vs_ddp(ctx: RankContext, impl: FSDPAdapter, strategy: str, optim: str) -> None:
    """10 steps with ``device_id=cpu``: every step's loss equals DDP's on the same data.

    Hybrid strategies run 2 (shard) x 2 (replicate) through an explicit group pair.
    Adam as in the seed, and SGD with momentum, which a wrong gradient scale changes.
    """
    world = cpu_world_group(ctx)
    group: Any = hybrid_cpu_groups(ctx, shard_size=2) if strategy in HYBRID_STRATEGIES else world
    model = SumOfInputsModel(seed=42)
    ddp = DistributedDataParallel(copy.deepcopy(model), process_group=world)
    fsdp = impl.wrap(model, WrapSpec(strategy=strategy, auto_wrap=ALWAYS, process_group=group, device_id=CPU))
    inp = torch.randn((2, 2), generator=generator(rank_seed(42, ctx.rank)))
    batches = [(inp, inp)] * 10
    runs = {
        "ddp": run_steps(ddp, make_optim(optim, ddp.parameters()), batches, _sum_loss),
        impl.name: run_steps(fsdp, make_optim(optim, fsdp.parameters()), batches, _sum_loss),
    }
    assert_runs_match(runs, reference="ddp")
    if strategy in HYBRID_STRATEGIES:
        # Units are inspected after training: before the first forward an
        # implementation may not have built its per-unit runtime state yet.
        sizes = {
            1 if u.replicate_group is None else torch.distributed.get_world_size(u.replicate_group)
            for u in impl.units(fsdp)
            if u.local_shards
        }
        assert sizes == {2}, f"{strategy}: replicate group sizes {sizes}, expected {{2}} (2 x 2 hybrid)"


@case("misc/module_no_compute_grad", world_size=2)
@pytest.mark.parametrize("use_second_layer", [True, False])
@pytest.mark.parametrize("strategy", ["NO_SHARD", None])
def test_module_no_compute_grad(
    ctx: RankContext, impl: FSDPAdapter, strategy: str | None, use_second_layer: bool
) -> None:
    """A unit outside the loss (unused, or used only for an ignored output) keeps grad None."""
    spec = WrapSpec(strategy=strategy, auto_wrap=ALWAYS)
    model = impl.wrap(OptionalSecondOutputModel(use_second_layer, seed=0).to(ctx.device), spec)
    gen = generator(rank_seed(0, ctx.rank))
    x = torch.randn((10, 10), generator=gen).to(ctx.device)
    y = torch.randn((10, 10), generator=gen).to(ctx.device)
    for step in range(4):
        out = model(x, y)
        (out[0] if use_second_layer else out).sum().backward()
        units = {u.fqn: u for u in impl.units(model)}
        assert {"a", "b"} <= set(units), f"expected units 'a' and 'b', got {sorted(units)}"
        for fqn, want_grad in (("a", True), ("b", False)):
            grads = units[fqn].local_grads
            assert grads, f"step {step}: unit {fqn!r} reports no local shards"
            have = [g is not None for g in grads]
            assert have == [want_grad] * len(grads), (
                f"step {step}, rank {ctx.rank}: unit {fqn!r} grad present {have}, expected all {want_grad}"
            )


@case("misc/not_all_outputs_used_in_loss", world_size=2, requires=[Capability.RESHARD_INTROSPECTION])
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


@case(
    "misc/optim_in_backward_requires_orig_params",
    world_size=2,
    requires=[Capability.OPTIM_IN_BACKWARD_CHECK, Capability.FLAT_PARAM],
)
def test_optim_in_backward_requires_orig_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = impl.wrap(SumOfInputsModel(seed=0).to(ctx.device), WrapSpec(auto_wrap=ALWAYS, use_orig_params=False))
    _apply_optimizer_in_backward(
        optimizer_class=torch.optim.SGD,
        params=model.parameters(),
        optimizer_kwargs={"lr": 0.03},
        register_hook=False,
    )
    inp = torch.randn((2, 2), generator=generator(rank_seed(0, ctx.rank))).to(ctx.device)
    with pytest.raises(RuntimeError, match="only supported with use_orig_params=True"):
        model(inp, inp)


_Quad = namedtuple("_Quad", ["a", "b", "c", "d"])


@case("misc/namedtuple_outputs", world_size=2)
def test_namedtuple_outputs(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Every tensor field of a namedtuple returned by a unit carries a backward hook."""
    model = impl.wrap(PassThroughModel(seed=0).to(ctx.device), WrapSpec())
    t = torch.ones(1, device=ctx.device, requires_grad=True)
    out = model(_Quad(t, t, t, t))
    assert isinstance(out, _Quad), f"namedtuple output came back as {type(out).__name__}"
    for name, field in zip(out._fields, out, strict=True):
        assert has_backward_hook(impl, field), f"rank {ctx.rank}: output field {name!r} has no backward hook"


HOMOGENEOUS_ATTRS = ["_use_orig_params", "limit_all_gathers", "_use_full_prec_in_eval"]


@case("misc/homogeneous_attributes", world_size=2, requires=[Capability.HOMOGENEOUS_ATTRIBUTES])
@pytest.mark.parametrize("attr", HOMOGENEOUS_ATTRS)
def test_homogeneous_attributes(ctx: RankContext, impl: FSDPAdapter, attr: str) -> None:
    """Inner unit False, outer unit True for an attribute that must agree: the first forward raises."""
    model = NestedModel(seed=0).to(ctx.device)
    if attr == "_use_full_prec_in_eval":
        model.module[1] = impl.wrap(model.module[1], WrapSpec())
        with env_on_all_ranks(ctx, "FSDP_USE_FULL_PREC_IN_EVAL", "1"):
            fsdp = impl.wrap(model, WrapSpec())
    else:
        field = attr.lstrip("_")
        model.module[1] = impl.wrap(model.module[1], WrapSpec(**{field: False}))
        fsdp = impl.wrap(model, WrapSpec(**{field: True}))
    (inp,) = NestedModel.get_input(ctx.device, generator(rank_seed(0, ctx.rank)))
    with pytest.raises(ValueError, match=f"Expects one homogeneous value for {attr}"):
        fsdp(inp)


CONTAINER_WARNING = "FSDP will not all-gather parameters for containers that do not implement forward"


@case("misc/unsupported_container_warning", world_size=2, requires=[Capability.CONTAINER_WARNING])
@pytest.mark.parametrize("container", ["ModuleList", "ModuleDict"])
def test_unsupported_container_warning(ctx: RankContext, impl: FSDPAdapter, container: str) -> None:
    mlps = [MLP(8, seed=i) for i in range(3)]
    module: nn.Module = (
        nn.ModuleList(mlps) if container == "ModuleList" else nn.ModuleDict({str(i): m for i, m in enumerate(mlps)})
    )
    with ctx.catch_warnings() as caught:
        impl.wrap(module, WrapSpec())
    assert any(issubclass(w.category, UserWarning) and re.search(CONTAINER_WARNING, str(w.message)) for w in caught), (
        f"rank {ctx.rank}: no UserWarning matching {CONTAINER_WARNING!r}; got {[str(w.message) for w in caught]}"
    )


NO_SHARD_SWITCH = "FSDP is switching to use `NO_SHARD` instead of"


@case("misc/world_size_1_no_shard_warning", world_size=1, requires=[Capability.WORLD_SIZE_1_SWITCH])
@pytest.mark.parametrize("strategy", ["NO_SHARD", "FULL_SHARD", None, "SHARD_GRAD_OP"])
def test_world_size_1_no_shard_warning(ctx: RankContext, impl: FSDPAdapter, strategy: str | None) -> None:
    """At world size 1 a sharded strategy (explicit or default) warns that it falls back to NO_SHARD."""
    with ctx.catch_warnings() as caught:
        impl.wrap(nn.Linear(3, 3), WrapSpec(strategy=strategy))
    switches = [
        str(w.message)
        for w in caught
        if issubclass(w.category, UserWarning) and str(w.message).startswith(NO_SHARD_SWITCH)
    ]
    if strategy == "NO_SHARD":
        assert not switches, f"NO_SHARD was asked for, yet warned: {switches}"
        return
    expected = re.escape(
        f"{NO_SHARD_SWITCH} ShardingStrategy.{strategy or 'FULL_SHARD'} since the world size is 1."
    )
    assert any(re.match(expected, m) for m in switches), f"no warning matching {expected!r}; got {switches}"


@case(
    "misc/same_model_across_ranks",
    world_size=2,
    requires=lambda p: [Capability.SYNC_MODULE_STATES] + ([Capability.COMPUTE_DEVICE] if p["use_device_id"] else []),
)
@pytest.mark.parametrize("use_device_id", [False, True])
def test_same_model_across_ranks(ctx: RankContext, impl: FSDPAdapter, use_device_id: bool) -> None:
    """sync_module_states=True makes every rank start from rank 0's parameters and buffers."""
    inner = RankInitModel(ctx.rank)
    assert_differs_across_ranks(inner.lin.weight.detach(), what="lin.weight before wrap")
    assert_differs_across_ranks(inner.buffer.detach(), what="buffer before wrap")
    if not use_device_id:
        inner.to(ctx.device)
    spec = WrapSpec(sync_module_states=True, device_id=ctx.device if use_device_id else None)
    fsdp = impl.wrap(inner, spec)
    state = {**impl.full_params(fsdp), "buffer": inner.buffer}
    assert_same_across_ranks(state, what="params and buffers after sync_module_states")
    rank0 = RankInitModel(0)
    torch.testing.assert_close(state["lin.weight"].cpu(), rank0.lin.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(state["buffer"].cpu(), rank0.buffer, rtol=0, atol=0)


@case("misc/unsafe_setattr", world_size=2, requires=[Capability.UNSAFE_SETATTR])
@pytest.mark.parametrize("env_value", [None, "1", "0"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_unsafe_setattr(ctx: RankContext, impl: FSDPAdapter, use_orig_params: bool, env_value: str | None) -> None:
    """FSDP_USE_UNSAFE_SETATTR=1 bypasses a module's __setattr__ in forward; unset or 0 goes through it."""
    inner = SetattrLinear(5, 5, seed=0).to(ctx.device)
    inp = torch.randn((8, 5), generator=generator(rank_seed(0, ctx.rank))).to(ctx.device)
    # The variable is set for wrap and forward alike: the catalogue does not
    # say when an implementation reads it (torch reads it at wrap time).
    with env_on_all_ranks(ctx, "FSDP_USE_UNSAFE_SETATTR", env_value):
        fsdp = impl.wrap(inner, WrapSpec(use_orig_params=use_orig_params))
        inner.setattr_calls.clear()
        fsdp(inp)
    calls = list(inner.setattr_calls)
    if env_value == "1":
        assert not calls, f"unsafe setattr on, yet the override saw {calls}"
    else:
        assert calls, f"FSDP_USE_UNSAFE_SETATTR={env_value!r}: forward never went through __setattr__"
