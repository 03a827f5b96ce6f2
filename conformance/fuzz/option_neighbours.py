"""Neighbours that set a construction option or a model the program has not: the options must take effect.

[Note: options a neighbour sets]
Three neighbours of a program's configuration ([Note: neighbours of a
configuration] in :mod:`conformance.fuzz.neighbours`) wrap a fresh model
with an option the program did not draw, and check what the option promises:

* a ``wrap`` program that is not hybrid (:attr:`Capability.SYNC_MODULE_STATES`):
  its model, initialised from another seed on each rank, wrapped as the program
  wraps it with ``sync_module_states=True``, holds rank 0's parameters on every
  rank (bit for bit: a broadcast and a shard copy values). The program's own
  model is the same on every rank, where the option would change nothing;
* a ``wrap`` program with a mixed-precision policy, not hybrid
  (:attr:`Capability.MP_KEEP_LOW_PRECISION_GRADS`): wrapped with that policy,
  reducing in its param dtype (no ``reduce_dtype``) and with
  ``keep_low_precision_grads=True``, a backward leaves the gradients the optimizer
  sees (those of ``parameters()``) in the param dtype: torch documents that FSDP
  then "keeps the gradients in the dtype used for gradient reduction". Reducing
  in the param dtype makes that dtype differ from the parameters', so an
  implementation upcasting anyway is seen;
* every program that is not hybrid: two blocks of one linear each, the second's
  weight tied to the first's, each block a unit (the program's API, strategy and
  parameter exposure) under a root unit. The contract (``param_kinds/shared``,
  ``uneven_shared/train``) lets an implementation refuse that, on every rank, at
  any point until its first optimizer step ends, or keep the tie: after an
  iteration and an SGD step the two names hold one value. Untied, each name
  gets the gradient of its own use, and the two differ.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, FSDPAdapter, WrapSpec
from conformance.contract.optional import fully_shard
from conformance.fuzz.controls import full_params_of
from conformance.fuzz.drawn_precision import dtype_of, mixed_precision_spec, wrapped_input
from conformance.fuzz.example import Block
from conformance.fuzz.model import FuzzBlock, FuzzModel, build_model, dense_batch, loss_of
from conformance.fuzz.ops import ProgramConfig, WrapConfig
from conformance.fuzz.shadow import batch_of
from conformance.fuzz.twin_checks import unwrapped_names
from fixtures.seeding import seeded_init_

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["keeps_low_precision_grads", "keeps_or_refuses_tie", "syncs_module_states"]

#: The tied weight's two names in :class:`_TiedAcrossUnits`.
_TIED = ("first.layers.0.weight", "second.layers.0.weight")


def syncs_module_states(ctx: RankContext, impl: FSDPAdapter, config: WrapConfig) -> None:
    """A model of another seed on each rank, wrapped with ``sync_module_states=True``, holds rank 0's (see the note)."""
    model = build_model(config.model, config.seed + 1 + ctx.rank, dtype_of(config.dtype), ctx.device)
    rank0 = build_model(config.model, config.seed + 1, dtype_of(config.dtype), ctx.device)
    with ctx.catch_warnings():  # at world size 1 the wrap warns of its switch to NO_SHARD
        wrapped = impl.wrap(model, WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params,
                                            sync_module_states=True))
    got = unwrapped_names(impl.full_params(wrapped))
    differ = sorted(name for name, param in rank0.named_parameters()
                    if name in got and not torch.equal(got[name], param.detach()))
    if differ:
        raise AssertionError(f"wrapped with sync_module_states=True (each rank's model of another seed), rank "
                             f"{ctx.rank} reads full values of {differ} other than rank 0's model: every rank starts "
                             "from rank 0's parameters")


def keeps_low_precision_grads(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: WrapConfig) -> None:
    """Wrapped with its policy, reducing in the param dtype and keeping low-precision gradients, a backward leaves
    the optimizer's gradients in the param dtype (see the note)."""
    assert config.policy is not None
    policy = replace(config.policy, reduce_dtype=None, keep_low_precision_grads=True)
    with ctx.catch_warnings():
        wrapped = impl.wrap(model, WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params,
                                            mixed_precision=mixed_precision_spec(policy)))
    loss_of(wrapped(wrapped_input(batch_of(config, 0, ctx.rank, ctx.device), policy))).backward()
    dtypes = sorted({str(param.grad.dtype) for param in wrapped.parameters() if param.grad is not None})
    want = str(dtype_of(policy.param_dtype))
    if dtypes and dtypes != [want]:
        raise AssertionError(f"with keep_low_precision_grads=True and reduction in the param dtype {want}, the "
                             f"optimizer's gradients are {dtypes}: they stay in the dtype of the reduction")


class _TiedAcrossUnits(nn.Module):
    """Two one-linear blocks, run one after the other, the second's weight the first's."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        self.first, self.second = FuzzBlock(Block(), width), FuzzBlock(Block(), width)
        seeded_init_(self, seed)
        self.second.layers[0].weight = self.first.layers[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def keeps_or_refuses_tie(ctx: RankContext, impl: FSDPAdapter, config: ProgramConfig) -> None:
    """A weight tied across two units is refused on every rank, or kept one through an iteration (see the note)."""
    dtype, width = dtype_of(config.dtype), config.model.width
    user = _TiedAcrossUnits(width, config.seed).to(ctx.device, dtype)
    batch = dense_batch(width, config.seed * 8 + ctx.rank, dtype, ctx.device)
    try:
        values = _trained_tie(ctx, impl, user, batch, config)
        refused = None
    except Exception as exc:  # noqa: BLE001 - the contract lets any refusal through
        values, refused = {}, f"{type(exc).__name__}: {str(exc)[:200]}"
    if not ctx.all_ranks_equal(refused is None):
        raise AssertionError(f"a weight tied across two units: rank {ctx.rank} "
                             f"{'trained' if refused is None else f'refused ({refused})'}, another rank did not")
    if len(values) == 2 and not torch.equal(*values.values()):
        gap = (values[_TIED[0]] - values[_TIED[1]]).abs().max().item()
        raise AssertionError(f"a weight tied across two units was accepted and trained as two parameters: after a "
                             f"step {_TIED[0]} and {_TIED[1]} differ by up to {gap:.3g}; the contract: refuse the tie "
                             "or keep it one parameter")


def _trained_tie(ctx: RankContext, impl: FSDPAdapter, user: _TiedAcrossUnits, batch: torch.Tensor,
                 config: ProgramConfig) -> dict[str, torch.Tensor]:
    """``user`` sharded (each block a unit, then the root) after an iteration and an SGD step: the full values of
    the tied weight's names it still lists."""
    if isinstance(config, WrapConfig):
        spec = WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params,
                        auto_wrap=AutoWrap(kind="module_names", module_names=("first", "second")))
        with ctx.catch_warnings():  # at world size 1 the wrap warns of its switch to NO_SHARD
            model = impl.wrap(user, spec)
    else:
        mesh = ctx.device_mesh((ctx.world_size,))
        first, second = fully_shard(impl, user.first, mesh=mesh), fully_shard(impl, user.second, mesh=mesh)
        user.first, user.second = first, second  # type: ignore[assignment]
        model = fully_shard(impl, user, mesh=mesh)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=0.1)
    loss_of(model(batch)).backward()
    optional.step(impl, model, optim)
    named = full_params_of(impl, model, config.api)
    return {name: named[name] for name in _TIED if name in named}
