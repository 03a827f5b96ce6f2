"""construction: what wrapping promises before the first step.

Every rank starts from the same model (``sync_module_states``), and wrap-time
checks and warnings: attributes that must agree across units, containers
without a forward, the NO_SHARD switch at world size 1, ``unsafe_setattr``,
and optimizer-in-backward needing original parameters.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn as nn
from torch.distributed.optim import _apply_optimizer_in_backward

from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, Exact, case
from conformance.contract.messages import (
    FULL_PRECISION_IN_EVAL,
    NO_SHARD_SWITCH,
    OPTIM_IN_BACKWARD_ERROR,
    UNSAFE_SETATTR,
)
from fixtures.misc_models import RankInitModel
from fixtures.models import (
    MLP,
    NestedModel,
    SetattrLinear,
    SumOfInputsModel,
)
from fixtures.parity import (
    assert_differs_across_ranks,
    assert_same_across_ranks,
)
from fixtures.rank_settings import env_on_all_ranks
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

ALWAYS = AutoWrap(kind="always")


@case(
    "construction/optim_in_backward_requires_orig_params", clause="C7",
    world_size=TWO_OR_MORE,
    requires=[Capability.OPTIM_IN_BACKWARD_CHECK, Capability.FLAT_PARAM],
)
def test_optim_in_backward_requires_orig_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    """With ``use_orig_params=False``, parameters given an optimizer-in-backward
    (``_apply_optimizer_in_backward``) make the first forward raise a RuntimeError saying it is
    "only supported with use_orig_params=True"."""
    model = impl.wrap(SumOfInputsModel(seed=0).to(ctx.device), WrapSpec(auto_wrap=ALWAYS, use_orig_params=False))
    _apply_optimizer_in_backward(
        optimizer_class=torch.optim.SGD,
        params=model.parameters(),
        optimizer_kwargs={"lr": 0.03},
        register_hook=False,
    )
    inp = torch.randn((2, 2), generator=generator(rank_seed(0, ctx.rank))).to(ctx.device)
    with pytest.raises(RuntimeError, match=OPTIM_IN_BACKWARD_ERROR):
        model(inp, inp)




HOMOGENEOUS_ATTRS = ["_use_orig_params", "limit_all_gathers", "_use_full_prec_in_eval"]


@case("construction/homogeneous_attributes", clause="C7", world_size=TWO_OR_MORE,
      requires=[Capability.HOMOGENEOUS_ATTRIBUTES, Capability.MANUAL_NESTING])
@pytest.mark.parametrize("attr", HOMOGENEOUS_ATTRS)
def test_homogeneous_attributes(ctx: RankContext, impl: FSDPAdapter, attr: str) -> None:
    """Inner unit False, outer unit True for an attribute that must agree: the first forward raises a
    ValueError "Expects one homogeneous value for <attr>"."""
    model = NestedModel(seed=0).to(ctx.device)
    if attr == "_use_full_prec_in_eval":
        model.module[1] = impl.wrap(model.module[1], WrapSpec())
        with env_on_all_ranks(ctx, FULL_PRECISION_IN_EVAL, "1"):
            fsdp = impl.wrap(model, WrapSpec())
    else:
        field = attr.lstrip("_")
        model.module[1] = impl.wrap(model.module[1], WrapSpec(**{field: False}))
        fsdp = impl.wrap(model, WrapSpec(**{field: True}))
    (inp,) = NestedModel.get_input(ctx.device, generator(rank_seed(0, ctx.rank)))
    with pytest.raises(ValueError, match=f"Expects one homogeneous value for {attr}"):
        fsdp(inp)


CONTAINER_WARNING = "FSDP will not all-gather parameters for containers that do not implement forward"


@case("construction/unsupported_container_warning", clause="C7", world_size=TWO_OR_MORE,
      requires=[Capability.CONTAINER_WARNING])
@pytest.mark.parametrize("container", ["ModuleList", "ModuleDict"])
def test_unsupported_container_warning(ctx: RankContext, impl: FSDPAdapter, container: str) -> None:
    """Wrapping a ModuleList or ModuleDict (a container with no forward) warns with a UserWarning that
    FSDP will not all-gather parameters for containers that do not implement forward."""
    mlps = [MLP(8, seed=i) for i in range(3)]
    module: nn.Module = (
        nn.ModuleList(mlps) if container == "ModuleList" else nn.ModuleDict({str(i): m for i, m in enumerate(mlps)})
    )
    with ctx.catch_warnings() as caught:
        impl.wrap(module, WrapSpec())
    assert any(issubclass(w.category, UserWarning) and re.search(CONTAINER_WARNING, str(w.message)) for w in caught), (
        f"rank {ctx.rank}: no UserWarning matching {CONTAINER_WARNING!r}; got {[str(w.message) for w in caught]}"
    )


@case("construction/world_size_1_no_shard_warning",
      world_size=Exact(1, reason="the switch to NO_SHARD is world size 1's behaviour"),
      requires=[Capability.WORLD_SIZE_1_SWITCH],
      clause="C7")
@pytest.mark.parametrize("strategy", ["NO_SHARD", "FULL_SHARD", None, "SHARD_GRAD_OP"])
def test_world_size_1_no_shard_warning(ctx: RankContext, impl: FSDPAdapter, strategy: str | None) -> None:
    """At world size 1 a sharded strategy (explicit or default) warns with a UserWarning that it switches
    to NO_SHARD, naming the strategy; NO_SHARD itself does not warn."""
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
    "construction/same_model_across_ranks", clause="C6",
    world_size=TWO_OR_MORE,
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


@case("construction/unsafe_setattr", clause="C21", world_size=TWO_OR_MORE, requires=[Capability.UNSAFE_SETATTR])
@pytest.mark.parametrize("env_value", [None, "1", "0"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_unsafe_setattr(ctx: RankContext, impl: FSDPAdapter, use_orig_params: bool, env_value: str | None) -> None:
    """FSDP_USE_UNSAFE_SETATTR=1 bypasses a module's __setattr__ in forward; unset or 0 goes through it."""
    inner = SetattrLinear(5, 5, seed=0).to(ctx.device)
    inp = torch.randn((8, 5), generator=generator(rank_seed(0, ctx.rank))).to(ctx.device)
    # The variable is set for wrap and forward alike: the catalogue does not
    # say when an implementation reads it (torch reads it at wrap time).
    with env_on_all_ranks(ctx, UNSAFE_SETATTR, env_value):
        fsdp = impl.wrap(inner, WrapSpec(use_orig_params=use_orig_params))
        inner.setattr_calls.clear()
        fsdp(inp)
    calls = list(inner.setattr_calls)
    if env_value == "1":
        assert not calls, f"unsafe setattr on, yet the override saw {calls}"
    else:
        assert calls, f"FSDP_USE_UNSAFE_SETATTR={env_value!r}: forward never went through __setattr__"
