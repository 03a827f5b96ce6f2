"""What a stateful program's configuration must refuse: the misuses next to it.

[Note: refused neighbours]
A program's configuration has invalid neighbours, calls one argument away from
it that the contract says must raise. Before its first operation every program
makes the ones its configuration has, each on a fresh copy of its model (a
refused call may leave a module half-made, so the program's own model is not
used), and each must raise the documented error on every rank:

* a hybrid ``wrap`` program ([Note: hybrid programs] in
  :mod:`conformance.cases.fuzz.wrapping`): its strategy given neither groups nor
  a mesh and no auto-wrap policy (:attr:`Capability.HYBRID_MANUAL_WRAP_CHECK`),
  and ``HYBRID_SHARD`` given the world's one group with a policy
  (:attr:`Capability.HYBRID_PG_VALIDATION`);
* a ``wrap`` program with flat parameters (``use_orig_params=False``): an
  optimizer-in-backward on the wrapped model's parameters, refused at its first
  forward (:attr:`Capability.OPTIM_IN_BACKWARD_CHECK`);
* a ``fully_shard`` program: ``fully_shard`` on the model's ``blocks`` (an
  ``nn.ModuleList``, which has no forward a hook could run: ``ValueError``), and
  on the root a second time (any exception: torch and the reference differ).

No draw decides them (a draw would move every seed: [Note: options from an
unused draw] in :mod:`conformance.cases.fuzz.drawing`), so every seed keeps the
programs it drew. The cases ``hybrid_shard/manual_wrap_requires_pg``,
``hybrid_shard/invalid_pg_specification``,
``construction/optim_in_backward_requires_orig_params`` and
``fully_shard_api/misuse`` check the same contract on their own models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from conformance.cases.fuzz.model import FuzzModel, build_model
from conformance.cases.fuzz.ops import Config
from conformance.cases.fuzz.precision import dtype_of
from conformance.cases.fuzz.shadow import batch_of
from conformance.cases.fuzz.wrapping import given_groups
from conformance.contract.adapter import (
    INVALID_PG_ERROR,
    MANUAL_WRAP_ERROR,
    OPTIM_IN_BACKWARD_ERROR,
    AutoWrap,
    Capability,
    FSDPAdapter,
    WrapSpec,
)
from conformance.contract.optional import fully_shard

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["check_refusals"]


def check_refusals(ctx: RankContext, impl: FSDPAdapter, config: Config) -> None:
    """Make each refused neighbour of ``config`` ([Note: refused neighbours]); raise ``AssertionError``
    naming the first one ``impl`` accepted or refused with another error."""

    def fresh() -> FuzzModel:
        return build_model(config.model, config.seed, dtype_of(config.dtype), ctx.device)

    if config.api == "fully_shard":
        mesh = ctx.device_mesh((ctx.world_size,))
        _refused("fully_shard on the model's blocks (an nn.ModuleList)", ValueError, "",
                 lambda: fully_shard(impl, fresh().blocks, mesh=mesh))
        sharded = fully_shard(impl, fresh(), mesh=mesh)
        _refused("fully_shard on a module already sharded", Exception, "",
                 lambda: fully_shard(impl, sharded, mesh=mesh))
        return
    caps = impl.capabilities
    if config.hybrid and Capability.HYBRID_MANUAL_WRAP_CHECK in caps:
        _refused(f"{config.strategy} without groups, a mesh or a policy", ValueError, MANUAL_WRAP_ERROR,
                 lambda: impl.wrap(fresh(), WrapSpec(strategy=config.strategy)))
    if config.hybrid and config.strategy == "HYBRID_SHARD" and Capability.HYBRID_PG_VALIDATION in caps:
        one_group = WrapSpec(strategy="HYBRID_SHARD", auto_wrap=AutoWrap((nn.Linear,)), process_group=ctx.group)
        _refused("HYBRID_SHARD given one process group", ValueError, INVALID_PG_ERROR,
                 lambda: impl.wrap(fresh(), one_group))
    if not config.use_orig_params and {Capability.OPTIM_IN_BACKWARD_CHECK, Capability.FLAT_PARAM} <= caps:
        _refused("an optimizer in backward with flat parameters", RuntimeError, OPTIM_IN_BACKWARD_ERROR,
                 lambda: _forward_with_optimizer_in_backward(ctx, impl, fresh(), config))


def _forward_with_optimizer_in_backward(ctx: RankContext, impl: FSDPAdapter, model: nn.Module,
                                        config: Config) -> Any:
    from torch.distributed.optim import _apply_optimizer_in_backward

    groups = given_groups(ctx, config)
    with ctx.catch_warnings():  # at world size 1 the wrap warns of its switch to NO_SHARD
        wrapped = impl.wrap(model, WrapSpec(strategy=config.strategy, use_orig_params=False, process_group=groups))
    _apply_optimizer_in_backward(torch.optim.SGD, wrapped.parameters(), {"lr": 0.1}, register_hook=False)
    return wrapped(batch_of(config, 0, ctx.rank, ctx.device))


def _refused(what: str, error: type[Exception], message: str, call: Callable[[], Any]) -> None:
    """``call()`` must raise ``error`` whose text contains ``message``."""
    try:
        call()
    except error as exc:
        if message not in str(exc):
            raise AssertionError(f"{what} raised {type(exc).__name__}({str(exc)[:200]!r}), "
                                 f"not one saying {message!r}") from None
        return
    except Exception as exc:  # noqa: BLE001 - any other error is the finding
        raise AssertionError(f"{what} raised {type(exc).__name__}({str(exc)[:200]!r}), "
                             f"not {error.__name__}") from None
    raise AssertionError(f"{what} was accepted: the contract refuses it")
