"""The neighbours of a stateful program's configuration: misuses it must refuse, options it must honour.

[Note: neighbours of a configuration]
A program's configuration has neighbours, calls one argument away from it whose
outcome the contract fixes: misuses that must raise (or warn, where the contract
lets training go on) and construction options that must take effect. After its
last operation a program that passed makes the ones its configuration has (so
that what the program itself shows is judged first, also on an implementation
that gets a neighbour wrong), each on a fresh copy of its model (a refused call
may leave a module half-made, so the program's own model is not used), and each
must behave so on every rank:

* a hybrid ``wrap`` program ([Note: hybrid programs] in
  :mod:`conformance.fuzz.wrapping`): its strategy given neither groups nor
  a mesh and no auto-wrap policy (:attr:`Capability.HYBRID_MANUAL_WRAP_CHECK`),
  and ``HYBRID_SHARD`` given the world's one group with a policy
  (:attr:`Capability.HYBRID_PG_VALIDATION`);
* a ``HYBRID_SHARD`` program: wrapped as it wraps but with its keeping form
  ``_HYBRID_SHARD_ZERO2``, a backward keeps that strategy's promise (no
  all-gather: [Note: all-gathers in backward] in :mod:`conformance.fuzz.gathers`);
* a ``wrap`` program with flat parameters (``use_orig_params=False``): an
  optimizer-in-backward on the wrapped model's parameters, refused at its first
  forward (:attr:`Capability.OPTIM_IN_BACKWARD_CHECK`);
* a ``fully_shard`` program: ``fully_shard`` on the model's ``blocks`` (an
  ``nn.ModuleList``, which has no forward a hook could run: ``ValueError``), and
  on the root a second time (any exception: torch and the reference differ);
* a ``fully_shard`` program on several ranks (:attr:`Capability.EXPLICIT_PREFETCH`):
  every unit given the next two as its prefetch lists, each pass all-gathers the
  units in order ([Note: prefetch lists in order] in
  :mod:`conformance.fuzz.prefetching`);
* a ``FULL_SHARD`` or ``SHARD_GRAD_OP`` ``wrap`` program on several ranks without
  a policy: wrapped as it wraps, a second iteration's forward gathers each unit
  only once the forward of the one before it began; and a ``FULL_SHARD`` one,
  each block a unit: its backward prefetches ([Note: prefetch as by default] in
  :mod:`conformance.fuzz.prefetching`);
* a ``FULL_SHARD`` or ``SHARD_GRAD_OP`` ``wrap`` program on several ranks whose
  first block holds parameters, with the debug level at DETAIL (:attr:`Capability.EXEC_ORDER_VALIDATION`): every
  rank but 0 running another unit than rank 0 does (of the same size). In the
  first forward that is refused (``RuntimeError``); after a first iteration it
  is warned of, once, on each rank that changed and on no other, and an eval
  forward between iterations in the same order warns nobody;
* a ``wrap`` program that is not hybrid, under a strategy that makes a unit per module
  (``units_per_module``): its strategy and parameter exposure with an auto-wrap policy
  naming the model's block class make every block that holds parameters, nested ones
  included, a unit, or a module holding units (a per-parameter design);
* every program that is not hybrid: a weight tied across two units refused or
  kept; a ``wrap`` one also ``sync_module_states`` and, with a policy,
  ``keep_low_precision_grads`` taking effect ([Note: options a neighbour sets] in
  :mod:`conformance.fuzz.option_neighbours`);
* a program with a policy, ``wrap`` (not hybrid, :attr:`Capability.NO_SYNC`) or
  ``fully_shard`` (:attr:`Capability.FULLY_SHARD_CONTROLS`): the sums kept without
  gradient sync add up in the dtype its API documents ([Note: unsynced sums made
  to show] in :mod:`conformance.fuzz.unsynced`);
* a ``wrap`` program (:attr:`Capability.UNSAFE_SETATTR`): its model, every layer
  given a ``__setattr__`` override that records its calls, wrapped as the
  program wraps under ``FSDP_USE_UNSAFE_SETATTR=1``, computes a forward without
  calling an override (torch: the variable makes FSDP bypass a module's
  ``__setattr__``; an implementation that never calls one honours it too);
* a ``wrap`` program with a mixed-precision policy, not hybrid
  (:attr:`Capability.MP_FULL_PRECISION_IN_EVAL`): the model wrapped with its
  policy under ``FSDP_USE_FULL_PREC_IN_EVAL=1`` computes an eval forward in
  full precision (float32 outputs).

No draw decides them (a draw would move every seed: [Note: options from an
unused draw] in :mod:`conformance.fuzz.drawing`), so every seed keeps the
programs it drew. The cases ``hybrid_shard/manual_wrap_requires_pg``,
``hybrid_shard/invalid_pg_specification``,
``construction/optim_in_backward_requires_orig_params``, ``fully_shard_api/misuse``,
``placement/device_id_auto_wrap``, ``construction/unsafe_setattr``, ``reshard/explicit_prefetch``,
``mixed_precision/full_precision_in_eval``, ``construction/same_model_across_ranks``,
``mixed_precision/keep_low_precision_grads``, ``param_kinds/shared`` and the ``exec_order`` cases check the same
contract on their own models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import _apply_optimizer_in_backward

from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.messages import (
    FULL_PRECISION_IN_EVAL,
    INVALID_PG_ERROR,
    MANUAL_WRAP_ERROR,
    OPTIM_IN_BACKWARD_ERROR,
    ORDER_CHANGED,
    ORDER_ERROR,
    ORDER_WARNING,
    UNSAFE_SETATTR,
)
from conformance.contract.optional import capabilities_of, fully_shard, units_per_module
from conformance.fuzz.agreement import agree, attempt
from conformance.fuzz.drawn_precision import dtype_of, mixed_precision_spec, wrapped_input
from conformance.fuzz.example import Block
from conformance.fuzz.gathers import Gathers
from conformance.fuzz.model import FuzzBlock, FuzzModel, build_model, dense_batch, holds_parameters, loss_of
from conformance.fuzz.ops import FullyShardConfig, ProgramConfig, WrapConfig
from conformance.fuzz.option_neighbours import keeps_low_precision_grads, keeps_or_refuses_tie, syncs_module_states
from conformance.fuzz.prefetching import fetches_when_used, prefetches_backward, prefetches_in_order
from conformance.fuzz.shadow import batch_of
from conformance.fuzz.unsynced import keeps_unsynced_sums
from conformance.fuzz.wrapping import given_groups, wrap_config
from fixtures.models import record_setattr
from fixtures.rank_settings import env_on_all_ranks, setting_on_all_ranks
from fixtures.seeding import seeded_init_

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["NEIGHBOURS_USE", "check_neighbours"]

#: What a neighbour wraps with where the adapter declares it, beyond what programs draw: a row running programs
#: declares these among its ``uses`` (else the declared-capability check refuses the wrap).
NEIGHBOURS_USE = (Capability.SYNC_MODULE_STATES, Capability.MP_KEEP_LOW_PRECISION_GRADS)
#: What the unsynced-sums neighbour needs under each API: its mixed precision and its backward without sync.
_WITHOUT_SYNC = {"wrap": frozenset({Capability.MIXED_PRECISION, Capability.NO_SYNC}),
                 "fully_shard": frozenset({Capability.FULLY_SHARD_MIXED_PRECISION, Capability.FULLY_SHARD_CONTROLS})}
#: The strategies sharding over the whole world: the order neighbour's (the ones the exec_order cases run), and the
#: all-gathers the no-forward-prefetch neighbour tells apart.
SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")


def check_neighbours(ctx: RankContext, impl: FSDPAdapter, config: ProgramConfig) -> str | None:
    """Make each neighbour of ``config`` ([Note: neighbours of a configuration]); the first one ``impl`` got
    wrong, the same text on every rank, or ``None``. Ranks agree after each neighbour, and a neighbour raises
    only after its last collective ([Note: fuzz verdicts agree across ranks] in
    :mod:`conformance.fuzz.agreement`)."""
    for name, step in _neighbours(ctx, impl, config):
        failure = agree(ctx, attempt(f"neighbour ({name})", step)[1])
        if failure is not None:
            return failure
    return None


def _neighbours(ctx: RankContext, impl: FSDPAdapter, config: ProgramConfig) -> list[tuple[str, Callable[[], None]]]:
    """The neighbours ``config`` has where ``impl`` declares what they need, each named, a call that raises
    ``AssertionError`` naming what ``impl`` got wrong."""

    def fresh() -> FuzzModel:
        return build_model(config.model, config.seed, dtype_of(config.dtype), ctx.device)

    steps = _of_wrap(ctx, impl, config, fresh) if isinstance(config, WrapConfig) else \
        _of_fully_shard(ctx, impl, config, fresh)
    if config.hybrid:
        return steps
    steps.append(("tied across units", lambda: keeps_or_refuses_tie(ctx, impl, config)))
    steps += _options(ctx, impl, config, fresh) if isinstance(config, WrapConfig) else []
    if config.policy is not None and _WITHOUT_SYNC[config.api] <= capabilities_of(impl):
        steps.append(("unsynced sums", lambda: keeps_unsynced_sums(ctx, impl, config)))
    return steps


def _of_fully_shard(ctx: RankContext, impl: FSDPAdapter, config: FullyShardConfig,
                    fresh: Callable[[], FuzzModel]) -> list[tuple[str, Callable[[], None]]]:
    """The neighbours of a ``fully_shard`` program's API."""
    mesh = ctx.device_mesh((ctx.world_size,))
    steps: list[tuple[str, Callable[[], None]]] = [
        ("misuse", lambda: _refused("fully_shard on the model's blocks (an nn.ModuleList)", ValueError, "",
                                    lambda: fully_shard(impl, fresh().blocks, mesh=mesh))),
        ("misuse", lambda: _shard_twice(ctx, impl, fresh()))]
    if ctx.world_size > 1 and Capability.EXPLICIT_PREFETCH in capabilities_of(impl):
        steps.append(("prefetch lists", lambda: prefetches_in_order(ctx, impl, fresh(), config)))
    return steps


def _of_wrap(ctx: RankContext, impl: FSDPAdapter, config: WrapConfig,
             fresh: Callable[[], FuzzModel]) -> list[tuple[str, Callable[[], None]]]:
    """The neighbours of a ``wrap`` program's strategy, parameter exposure and policy."""
    caps = capabilities_of(impl)
    steps: list[tuple[str, Callable[[], None]]] = []
    if config.hybrid and Capability.HYBRID_MANUAL_WRAP_CHECK in caps:
        bare = WrapSpec(strategy=config.strategy)
        steps.append(("misuse", lambda: _refused(f"{config.strategy} without groups, a mesh or a policy", ValueError,
                                                MANUAL_WRAP_ERROR, lambda: impl.wrap(fresh(), bare))))
    if config.strategy == "HYBRID_SHARD":
        steps.append(("keeping form", lambda: _keeping_form(ctx, impl, fresh(), config)))
    if config.hybrid and config.strategy == "HYBRID_SHARD" and Capability.HYBRID_PG_VALIDATION in caps:
        one_group = WrapSpec(strategy="HYBRID_SHARD", auto_wrap=AutoWrap((nn.Linear,)), process_group=ctx.group)
        steps.append(("misuse", lambda: _refused("HYBRID_SHARD given one process group", ValueError,
                                                INVALID_PG_ERROR, lambda: impl.wrap(fresh(), one_group))))
    if not config.use_orig_params and {Capability.OPTIM_IN_BACKWARD_CHECK, Capability.FLAT_PARAM} <= caps:
        steps.append(("misuse", lambda: _refused("an optimizer in backward with flat parameters", RuntimeError,
                                                OPTIM_IN_BACKWARD_ERROR,
                                                lambda: _forward_with_optimizer_in_backward(ctx, impl, fresh(),
                                                                                            config))))
    if not config.hybrid and units_per_module(impl, config.strategy):
        steps.append(("auto-wrap policy", lambda: _auto_wrap(ctx, impl, fresh(), config)))
    if Capability.UNSAFE_SETATTR in caps:
        steps.append((f"{UNSAFE_SETATTR}=1", lambda: _bypasses_setattr(ctx, impl, fresh(), config)))
    if config.policy is not None and not config.hybrid and {Capability.MIXED_PRECISION,
                                                           Capability.MP_FULL_PRECISION_IN_EVAL} <= caps:
        steps.append((f"{FULL_PRECISION_IN_EVAL}=1", lambda: _full_precision_in_eval(ctx, impl, fresh(), config)))
    if config.world_size > 1 and config.strategy in SHARDED and config.policy is None:
        steps.append(("prefetch defaults", lambda: fetches_when_used(ctx, impl, fresh(), config)))
    if config.world_size > 1 and config.strategy == "FULL_SHARD":
        steps.append(("backward prefetch", lambda: prefetches_backward(ctx, impl, fresh(), config)))
    if config.world_size > 1 and config.strategy in SHARDED and Capability.EXEC_ORDER_VALIDATION in caps \
            and holds_parameters(FuzzBlock(config.model.blocks[0], config.model.width)):
        steps.append(("unit order", lambda: _at_debug_detail(ctx, impl, config)))
    return steps


def _options(ctx: RankContext, impl: FSDPAdapter, config: WrapConfig,
             fresh: Callable[[], FuzzModel]) -> list[tuple[str, Callable[[], None]]]:
    """The neighbours of a ``wrap`` program that is not hybrid setting an option it did not draw ([Note: options a
    neighbour sets] in :mod:`conformance.fuzz.option_neighbours`)."""
    caps = capabilities_of(impl)
    steps: list[tuple[str, Callable[[], None]]] = []
    if Capability.SYNC_MODULE_STATES in caps:
        steps.append(("sync_module_states", lambda: syncs_module_states(ctx, impl, config)))
    if config.policy is not None and {Capability.MIXED_PRECISION, Capability.MP_KEEP_LOW_PRECISION_GRADS} <= caps:
        steps.append(("keep_low_precision_grads", lambda: keeps_low_precision_grads(ctx, impl, fresh(), config)))
    return steps


def _keeping_form(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: WrapConfig) -> None:
    """The program wrapped with ``_HYBRID_SHARD_ZERO2`` for its ``HYBRID_SHARD``: its backward keeps the promise of a
    strategy that keeps the unsharded parameters ([Note: all-gathers in backward] in
    :mod:`conformance.fuzz.gathers`)."""
    keeping = replace(config, strategy="_HYBRID_SHARD_ZERO2")
    groups = given_groups(ctx, keeping)
    gathers = Gathers(keeping, build_model(config.model, config.seed, dtype_of(config.dtype), ctx.device),
                      shard_group=groups and groups[0])
    wrapped = wrap_config(ctx, impl, model, keeping, groups)
    loss = loss_of(wrapped(wrapped_input(batch_of(config, 0, ctx.rank, ctx.device), config.policy)))
    gathers.started()
    with gathers.backward():
        loss.backward()
    gathers.check()



def _shard_twice(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel) -> None:
    mesh = ctx.device_mesh((ctx.world_size,))
    sharded = fully_shard(impl, model, mesh=mesh)
    _refused("fully_shard on a module already sharded", Exception, "", lambda: fully_shard(impl, sharded, mesh=mesh))


def _at_debug_detail(ctx: RankContext, impl: FSDPAdapter, config: WrapConfig) -> None:
    """:func:`_order_changes` at debug level DETAIL, set before it wraps (an implementation may read it there)."""
    with setting_on_all_ranks(ctx, dist.get_debug_level, dist.set_debug_level, dist.DebugLevel.DETAIL):
        _order_changes(ctx, impl, config)


def _full_precision_in_eval(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: WrapConfig) -> None:
    """Wrapped with its policy under ``FSDP_USE_FULL_PREC_IN_EVAL=1``, an eval forward computes in full precision."""
    with env_on_all_ranks(ctx, FULL_PRECISION_IN_EVAL, "1"), ctx.catch_warnings():
        wrapped = impl.wrap(model, WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params,
                                            mixed_precision=mixed_precision_spec(config.policy)))
    wrapped.eval()
    with torch.no_grad():
        output = wrapped(batch_of(config, 0, ctx.rank, ctx.device))
    dtypes = sorted({str(o.dtype) for o in (output if isinstance(output, tuple) else (output,))})
    if dtypes != [str(torch.float32)]:
        raise AssertionError(f"wrapped with {FULL_PRECISION_IN_EVAL}=1 and a mixed-precision policy, an eval forward "
                             f"returned {dtypes}: eval computes in full precision")


def _bypasses_setattr(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: WrapConfig) -> None:
    """Wrapped as the program wraps under ``FSDP_USE_UNSAFE_SETATTR=1``, a forward with gradients calls no layer's
    ``__setattr__`` override (the calls of the wrap itself are not counted)."""
    layers = [module for module in model.modules() if any(True for _ in module.parameters(recurse=False))]
    recorded = {layer: record_setattr(layer) for layer in layers}
    with env_on_all_ranks(ctx, UNSAFE_SETATTR, "1"):
        wrapped = wrap_config(ctx, impl, model, config, given_groups(ctx, config))
        for calls in recorded.values():
            calls.clear()
        wrapped(wrapped_input(batch_of(config, 0, ctx.rank, ctx.device), config.policy))
    names = sorted({f"{type(layer).__name__}.{name}" for layer, calls in recorded.items() for name in calls})
    if names:
        raise AssertionError(f"under {UNSAFE_SETATTR}=1 a forward went through modules' __setattr__ "
                             f"overrides, setting {names}: the variable bypasses them")


def _auto_wrap(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: WrapConfig) -> None:
    """An auto-wrap policy naming the block class makes every block a unit (see the note)."""
    blocks = [name for name, module in model.named_modules()
              if isinstance(module, FuzzBlock) and holds_parameters(module)]
    spec = WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params, auto_wrap=AutoWrap((FuzzBlock,)))
    with ctx.catch_warnings():  # at world size 1 the wrap warns of its switch to NO_SHARD
        wrapped = impl.wrap(model, spec)
    units = [unit.fqn for unit in impl.units(wrapped)]
    bare = [name for name in blocks if not any(fqn == name or fqn.startswith(name + ".") for fqn in units)]
    if bare:
        raise AssertionError(f"an auto-wrap policy naming {FuzzBlock.__name__} left blocks {bare} without a unit "
                             f"(units: {units})")


class _TwoPaths(nn.Module):
    """Two blocks of one kind, of which a forward runs the first, or the second once ``switched``."""

    def __init__(self, block: Block, width: int) -> None:
        super().__init__()
        self.first, self.second = FuzzBlock(block, width), FuzzBlock(block, width)
        self.switched = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.second if self.switched else self.first)(x)


def _order_changes(ctx: RankContext, impl: FSDPAdapter, config: WrapConfig) -> None:
    """Ranks running their units in different orders (see the note): refused in the first forward; after it,
    each rank that changed is warned once, and eval forwards with the same order warn nobody. The model is the
    config's first block twice, each a unit, and ranks other than 0 run the second where rank 0 runs the first:
    units of one size, so that every rank issues the same collectives (an implementation that does not check
    pairs them silently; training goes on after the warning) and only the order check can tell."""
    dtype, width = dtype_of(config.dtype), config.model.width
    batch = dense_batch(width, config.seed * 8 + ctx.rank, dtype, ctx.device)
    model, user = _unit_per_block(ctx, impl, config)
    user.switched = ctx.rank != 0
    _refused("a first forward whose unit order differs across ranks", RuntimeError, ORDER_ERROR, lambda: model(batch))
    model, user = _unit_per_block(ctx, impl, config)
    with ctx.catch_warnings() as same:
        loss_of(model(batch)).backward()
        with torch.no_grad():
            model.eval()
            model(batch)
            model.train()
        loss_of(model(batch)).backward()
    user.switched = ctx.rank != 0
    with ctx.catch_warnings() as changed:
        loss_of(model(batch)).backward()
    with ctx.catch_warnings() as after:
        loss_of(model(batch)).backward()
    # judged after the last collective, so that no rank leaves the others waiting in one
    _order_warnings(same, "", "with the same unit order on every rank, an eval forward between iterations")
    _order_warnings(changed, ORDER_CHANGED.format(rank=ctx.rank) if ctx.rank else "",
                    "in the first iteration after " + ("this rank" if ctx.rank else "other ranks") + " changed order")
    _order_warnings(after, "", "in the second iteration after a change of order (warned once already)")


def _unit_per_block(ctx: RankContext, impl: FSDPAdapter, config: WrapConfig) -> tuple[nn.Module, _TwoPaths]:
    """A fresh :class:`_TwoPaths` of the config's first block, each block a unit, wrapped; and the user's module."""
    user = _TwoPaths(config.model.blocks[0], config.model.width)
    seeded_init_(user, config.seed)
    user.to(ctx.device, dtype_of(config.dtype))
    units = AutoWrap(kind="module_names", module_names=("first", "second"))
    return impl.wrap(user, WrapSpec(strategy=config.strategy, auto_wrap=units)), user


def _order_warnings(caught: list[Any], expected: str, when: str) -> None:
    """The order warnings ``caught`` are one starting ``expected``, or none where ``expected`` is empty."""
    got = [str(w.message) for w in caught if str(w.message).startswith(ORDER_WARNING)]
    if expected and not any(message.startswith(expected) for message in got):
        raise AssertionError(f"{when}: no warning {expected!r}..., got {got}")
    if len(got) > (1 if expected else 0):
        raise AssertionError(f"{when}: warned {got}")


def _forward_with_optimizer_in_backward(ctx: RankContext, impl: FSDPAdapter, model: nn.Module,
                                        config: WrapConfig) -> Any:
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
