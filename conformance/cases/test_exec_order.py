"""exec_order: ranks must all-gather units in the same order, or be told they do not.

The model has two paths, ``layer0 -> layer1`` and ``layer0 -> layer2``, whose
inner units flatten to the same size (36), so an implementation without
order checks would silently pair the wrong collectives. Checks are on when the
``torch.distributed`` debug level is DETAIL (set before wrapping, as an
implementation may read it at construction).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.messages import ORDER_CHANGED, ORDER_ERROR, ORDER_WARNING
from conformance.contract.optional import wrapped_module
from fixtures.models import ExecOrderModel
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP"]
REQUIRES = [Capability.EXEC_ORDER_VALIDATION]


def _wrap(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> nn.Module:
    """The seed's nesting: layer1 and layer2 are their own units under a root unit."""
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    spec = WrapSpec(strategy=strategy, auto_wrap=AutoWrap(kind="module_names", module_names=("layer1", "layer2")))
    return impl.wrap(ExecOrderModel(seed=0), spec).to(ctx.device)


def _inner(impl: FSDPAdapter, model: nn.Module) -> ExecOrderModel:
    inner = wrapped_module(impl, model)
    assert isinstance(inner, ExecOrderModel), type(inner)
    return inner


def _step(ctx: RankContext, model: nn.Module, gen: torch.Generator, *, backward: bool = True) -> None:
    (inp,) = ExecOrderModel.get_input(ctx.device, gen)
    loss = ExecOrderModel.get_loss(model(inp))
    if backward:
        loss.backward()


@case("exec_order/invalid_first_iter_order", clause="C8", world_size=TWO_OR_MORE, requires=REQUIRES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_invalid_first_iter_order(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
    """When rank 1 runs its units in another order than rank 0 in the first forward (debug level
    DETAIL), that forward raises a RuntimeError starting "Forward order differs across ranks"."""
    model = _wrap(ctx, impl, strategy)
    if ctx.rank != 0:
        _inner(impl, model).flip_path()
    gen = generator(rank_seed(0, ctx.rank))
    (inp,) = ExecOrderModel.get_input(ctx.device, gen)
    with pytest.raises(RuntimeError, match=f"^{ORDER_ERROR}"):
        model(inp)


@case("exec_order/invalid_later_iter_order", clause="C8", world_size=TWO_OR_MORE, requires=REQUIRES)
@pytest.mark.parametrize("iters_before_path_change", [1, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_invalid_later_iter_order(
    ctx: RankContext, impl: FSDPAdapter, strategy: str, iters_before_path_change: int
) -> None:
    """After 1 or 3 good steps, rank 1 changing its forward order gets one UserWarning "Forward order differs
    from that of the first iteration on rank 1..." and rank 0 none; the next step trains on every rank with
    no further order warning."""
    model = _wrap(ctx, impl, strategy)
    gen = generator(rank_seed(0, ctx.rank))
    for _ in range(iters_before_path_change):
        _step(ctx, model, gen)
    if ctx.rank != 0:
        _inner(impl, model).flip_path()
    expected = re.escape(ORDER_CHANGED.format(rank=ctx.rank))
    with ctx.catch_warnings() as caught:
        _step(ctx, model, gen)
    order_warnings = [w for w in caught if str(w.message).startswith(ORDER_WARNING)]
    if ctx.rank == 0:
        assert not order_warnings, f"rank 0 kept its order but was warned: {order_warnings[0].message}"
    else:
        assert any(
            issubclass(w.category, UserWarning) and re.match(f"^({expected})", str(w.message))
            for w in order_warnings
        ), f"rank {ctx.rank}: no matching UserWarning; got {[str(w.message) for w in caught]}"
    # Training continues after the warning, and the warning was the only one: the
    # next full step completes on every rank without another order warning.
    with ctx.catch_warnings() as later:
        _step(ctx, model, gen)
    repeated = [str(w.message) for w in later if str(w.message).startswith(ORDER_WARNING)]
    assert not repeated, f"rank {ctx.rank}: order warning repeated after the path change: {repeated[0]}"
    ctx.barrier()


@case("exec_order/train_eval", clause="C8", world_size=TWO_OR_MORE, requires=REQUIRES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_train_eval(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
    """Switching between train (forward and backward) and eval (forward only) steps over two epochs, with
    the same order on every rank, issues no "Forward order differs" warning."""
    model = _wrap(ctx, impl, strategy)
    gen = generator(rank_seed(0, ctx.rank))
    with ctx.catch_warnings() as caught:
        for _epoch in range(2):
            model.train()
            for _ in range(3):
                _step(ctx, model, gen)
            model.eval()
            for _ in range(3):
                _step(ctx, model, gen, backward=False)
    wrong = [str(w.message) for w in caught if str(w.message).startswith(ORDER_WARNING)]
    assert not wrong, f"rank {ctx.rank}: order warning issued on a train/eval switch: {wrong[0]}"
