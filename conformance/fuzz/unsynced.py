"""A neighbour of a program with a mixed-precision policy: where gradients kept without sync add up.

[Note: unsynced sums made to show]
Between a backward without gradient sync (inside ``no_sync()``, or with
``set_requires_gradient_sync(False)``) and the next synchronizing one, each rank
keeps its gradient and adds the next one to it, in a dtype its API documents
([Note: unsynced accumulation dtype] in :mod:`conformance.fuzz.shadow`,
:func:`~conformance.fuzz.shadow.unsynced_dtype`). Keeping it in another
dtype moves each rank's sum by at most half a unit in the last place of the
param dtype: under that dtype's tolerance, so a program shows it only where
the ranks' sums happen to nearly cancel in the reduction. This neighbour makes
them cancel. With the program's API and policy, reducing in ``float32``, it
shards a linear layer without bias, whose weight gets its input as gradient
under a sum loss, so each gradient is chosen: 1 then 3/4 of the param dtype's
epsilon on even ranks, -1 then 0 on odd ones. Each is exact in the param dtype
and so is every product; only the sum 1 + 3/4 eps is not: kept in the param
dtype it rounds to 1 + eps, kept in ``float32`` it stays. The reduction
cancels the 1s and leaves eps/2 per pair of ranks where a ``float32`` sum
leaves 3/8 eps, a quarter of the value apart. After an SGD step at learning
rate 1 from zero the weight is minus the gradient, read as the user reads
parameters and compared in the param dtype at its default tolerance. At world
size 1 nothing cancels and the two dtypes cannot be told apart.

It runs after a ``wrap`` program with a policy, not hybrid
(:attr:`Capability.NO_SYNC`: ``no_sync()``, the sum kept in the param dtype), and
after a ``fully_shard`` one with a policy (:attr:`Capability.FULLY_SHARD_CONTROLS`:
``set_requires_gradient_sync``, the sum kept in ``reduce_dtype``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import FSDPAdapter, WrapSpec
from conformance.contract.optional import fully_shard, no_sync, set_requires_gradient_sync
from conformance.fuzz.controls import full_params_of
from conformance.fuzz.drawn_precision import dtype_of, mixed_precision_spec
from conformance.fuzz.ops import ProgramConfig, WrapConfig
from conformance.fuzz.shadow import unsynced_dtype
from fixtures.precision import average_grads

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["keeps_unsynced_sums"]

#: The backward without gradient sync, in each API's terms.
_WITHOUT_SYNC = {"wrap": "a backward inside no_sync()", "fully_shard": "a backward with gradient sync off"}
#: What each API's documentation says of the dtype a kept gradient adds up in.
_DOCUMENTED = {"wrap": "no_sync() accumulates in the parameters the backward computes with; reduce_dtype is the "
                       "reduction's only",
               "fully_shard": "FSDP2's MixedPrecisionPolicy: with gradient sync off, gradients accumulate in "
                              "reduce_dtype"}


def keeps_unsynced_sums(ctx: RankContext, impl: FSDPAdapter, config: ProgramConfig) -> None:
    """With the program's API and policy, reducing in ``float32``, a backward without gradient sync and the next
    one leave the mean over ranks of each rank's sum kept in the API's dtype (see the note)."""
    assert config.policy is not None
    policy = replace(config.policy, reduce_dtype="float32", keep_low_precision_grads=False)
    config = replace(config, policy=policy)
    low, kept = dtype_of(policy.param_dtype), unsynced_dtype(config)
    user = nn.Linear(config.model.width, 1, bias=False, device=ctx.device, dtype=dtype_of(config.dtype))
    nn.init.zeros_(user.weight)
    model = _sharded(ctx, impl, user, config)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=1.0)
    first, second = _inputs(ctx.rank, config.model.width, low, ctx.device)
    with _without_sync(impl, model, config.api):
        model(first).float().sum().backward()
    model(second).float().sum().backward()
    optional.step(impl, model, optim)
    got = full_params_of(impl, model, config.api)["weight"].to(low)
    sums = [{"weight": torch.add(*(g.to(kept) for g in _inputs(rank, config.model.width, low, ctx.device)))}
            for rank in range(ctx.world_size)]
    want = -average_grads(sums, torch.float32)["weight"].to(low)  # SGD at lr 1 from zero: minus the gradient
    try:
        torch.testing.assert_close(got, want)
    except AssertionError as exc:
        raise AssertionError(
            f"with param_dtype={policy.param_dtype} and reduce_dtype=float32, {_WITHOUT_SYNC[config.api]} "
            f"and the next one left a gradient other than the mean over ranks of each rank's sum kept in "
            f"{str(kept).removeprefix('torch.')} ({_DOCUMENTED[config.api]}): {exc}") from None


def _sharded(ctx: RankContext, impl: FSDPAdapter, user: nn.Module, config: ProgramConfig) -> nn.Module:
    spec = mixed_precision_spec(config.policy)
    if not isinstance(config, WrapConfig):
        return fully_shard(impl, user, mesh=ctx.device_mesh((ctx.world_size,)), mixed_precision=spec)
    with ctx.catch_warnings():  # at world size 1 the wrap warns of its switch to NO_SHARD
        return impl.wrap(user, WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params,
                                        mixed_precision=spec))


@contextmanager
def _without_sync(impl: FSDPAdapter, model: nn.Module, api: str) -> Iterator[None]:
    """``no_sync()`` for a wrapped model; gradient sync off, then on again, for a ``fully_shard``-ed one."""
    if api == "wrap":
        with no_sync(impl, model):
            yield
        return
    set_requires_gradient_sync(impl, model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(impl, model, True)


def _inputs(rank: int, width: int, low: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs (one row each, in ``low``) to the backward without sync and the one after it: with
    a sum loss they are the weight's gradients (see the note)."""
    eps = torch.finfo(low).eps
    first, second = (-1.0, 0.0) if rank % 2 else (1.0, 0.75 * eps)
    return (torch.full((1, width), first, dtype=low, device=device),
            torch.full((1, width), second, dtype=low, device=device))
