"""A ``fully_shard`` program's explicit prefetch lists, followed in their order.

[Note: prefetch lists in order]
``set_modules_to_forward_prefetch`` and ``set_modules_to_backward_prefetch``
take a list of modules to all-gather after the module's own ("the prefetching
runs after this module's all-gather copy-out", torch documents), issued in the
list's order (as torch's FSDP2 does, and ``reshard/explicit_prefetch``
requires). A ``fully_shard`` program on several ranks, where the adapter
declares :attr:`Capability.EXPLICIT_PREFETCH`, shards a fresh copy of its model
as it does and gives every unit the next two units as its list, in forward order
for a forward, in backward order (the root, then the others reversed) for the
backward after it; then every unit is all-gathered, for the first time in that
pass, in that order. A unit is told by the bytes a rank sends to its all-gather:
one unit's parameters over the world, padded neither way or either way a torch
FSDP pads ([Note: memory held between iterations] in
:mod:`conformance.fuzz.held`); the check is made only where no two units
share such a size (else an all-gather could be either), counts the all-gathers
over the whole world only (an int ``reshard_after_forward`` gathers backward's
over smaller groups, with smaller pieces), and leaves out an all-gather of
another size (an implementation padding another way is not judged). Forward
lists are emptied before the backward: a checkpointed block's recomputation is a
forward inside backward, where the forward lists are not what is checked.
``reshard/explicit_prefetch`` checks the same contract on its own model.

[Note: prefetch as by default]
``forward_prefetch`` is off by default, and torch documents turning it on as
what makes FSDP1 issue "the next forward-pass all-gather before the current
forward computation": off, a unit's parameters are gathered when its forward
comes, and a unit more is held at a time when it is on. Backward prefetch is on
by default (``BACKWARD_PRE``, [Note: all-gathers in backward] in
:mod:`conformance.fuzz.gathers`). A ``FULL_SHARD`` or ``SHARD_GRAD_OP``
``wrap`` program on several ranks, without a policy (whose param dtype would
change the sizes), wraps a fresh copy of its model as it does, trains an
iteration (torch's FSDP1 prefetches from the second, once it knows the order),
and in the next forward every unit after the first is all-gathered only after
the forward of the unit before it began (seen by a forward pre-hook on the
user's module, registered before wrapping; units are told by size as above,
judged where no two share one). A ``FULL_SHARD`` ``wrap`` program on several
ranks whose model has two blocks or more holding parameters wraps another fresh
copy with each such block a unit under the root (the program's strategy and
exposure, no policy), trains an iteration, and in the next backward, of two or
more all-gathers the second must come before the first reduce-scatter, as the
program's own backwards must show ([Note: all-gathers in backward] in
:mod:`conformance.fuzz.gathers`). That check needs sibling units, which a
program's own plan may lack: a unit nested at the end of another starts its
backward with it, so both are gathered before either reduces, prefetch or not;
and a frozen unit gathers and reduces nothing. So the copy has its own plan and
nothing frozen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conformance.contract.adapter import AutoWrap, FSDPAdapter, WrapSpec
from conformance.contract.optional import set_modules_to_prefetch
from conformance.fuzz.controls import module_at, shard_config
from conformance.fuzz.gathers import GATHERS, REDUCTIONS, assert_backward_prefetched
from conformance.fuzz.held import shard_sizes, units_of
from conformance.fuzz.model import FuzzModel, holds_parameters, loss_of
from conformance.fuzz.ops import FullyShardConfig, ProgramConfig, WrapConfig
from conformance.fuzz.shadow import batch_of
from conformance.fuzz.wrapping import wrap_config
from harness.collectives.recorder import Call, describe, patch_collectives

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["fetches_when_used", "prefetches_backward", "prefetches_in_order"]

_LISTED = 2  # units in each list


def prefetches_in_order(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: FullyShardConfig) -> None:
    """``model`` (a fresh copy) sharded as ``config`` says, with every unit's prefetch lists the next two units:
    each pass all-gathers the units in order (see the note)."""
    spans = _spans(model, config)
    if spans is None:
        return
    sharded = shard_config(ctx, impl, model, config)
    forward = list(spans)
    backward = forward[:1] + forward[:0:-1]
    modules = {path: module_at(sharded, path) for path in forward}
    for index, path in enumerate(forward):
        set_modules_to_prefetch(impl, modules[path], forward=[modules[p] for p in forward[index + 1:][:_LISTED]])
    with ctx.record_collectives() as forward_calls:
        loss = loss_of(sharded(batch_of(config, 0, ctx.rank, ctx.device)))
    for index, path in enumerate(backward):
        set_modules_to_prefetch(impl, modules[path], forward=[],
                                backward=[modules[p] for p in backward[index + 1:][:_LISTED]])
    with ctx.record_collectives() as backward_calls:
        loss.backward()
    _in_order(_gathered(forward_calls.calls, spans, ctx.world_size), forward, "forward")
    _in_order(_gathered(backward_calls.calls, spans, ctx.world_size), backward, "backward")


def _spans(model: FuzzModel, config: ProgramConfig) -> dict[str, frozenset[int]] | None:
    """Each unit of ``model`` (not sharded yet) with parameters, in forward order -> the bytes a rank may send to
    its all-gather; ``None`` where two units may send as many (see the note)."""
    units = units_of(model, config)
    spans = {path: frozenset(shard_sizes(units[path], config.world_size)) for path in config.units() if path in units}
    sizes = [size for candidates in spans.values() for size in candidates]
    if len(spans) <= _LISTED or len(sizes) != len(set(sizes)):
        return None
    return spans


def _gathered(calls: list[Call], spans: dict[str, frozenset[int]], world: int) -> list[str]:
    """The units the whole-world all-gathers of ``calls`` gathered, each at its first, in issue order."""
    order: list[str] = []
    for call in calls:
        unit = _unit_of(call, spans, world)
        if unit is not None and unit not in order:
            order.append(unit)
    return order


def _unit_of(call: Call, spans: dict[str, frozenset[int]], world: int) -> str | None:
    """The unit a whole-world all-gather gathered, told by its size; ``None`` for another collective or size
    (one of no unit's size gathers something else)."""
    if call.op not in GATHERS or len(call.group_ranks) != world:
        return None
    return next((path for path, sizes in spans.items() if call.bytes in sizes), None)


def _in_order(gathered: list[str], order: list[str], what: str) -> None:
    """``gathered`` follows ``order`` (units it skipped aside)."""
    expected = [path for path in order if path in gathered]
    if gathered != expected:
        names = [path or "<root>" for path in gathered]
        raise AssertionError(f"with prefetch lists of the next {_LISTED} units in {what} order, {what} all-gathered "
                             f"the units in the order {names}, not {[path or '<root>' for path in expected]}")


def fetches_when_used(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: WrapConfig) -> None:
    """``model`` (a fresh copy) wrapped as ``config`` says (no forward prefetch): in a second iteration's forward
    each unit is all-gathered after the forward of the one before it began ([Note: prefetch as by default])."""
    spans = _spans(model, config)
    if spans is None:
        return
    order, events = list(spans), []
    for path in order:
        model.get_submodule(path).register_forward_pre_hook(lambda *_, path=path: events.append(f"enter {path}"))
    wrapped = wrap_config(ctx, impl, model, config, None)
    batch = batch_of(config, 0, ctx.rank, ctx.device)
    loss_of(wrapped(batch)).backward()

    def recorded(op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        unit = _unit_of(describe(op, fn, args, kwargs), spans, ctx.world_size) if op in GATHERS else None
        if unit is not None:
            events.append(f"gather {unit}")
        return fn(*args, **kwargs)

    events.clear()
    with patch_collectives(recorded, barrier=False):
        loss = loss_of(wrapped(batch))
    loss.backward()
    early = [path for before, path in zip(order, order[1:], strict=False)
             if {f"gather {path}", f"enter {before}"} <= set(events)
             and events.index(f"gather {path}") < events.index(f"enter {before}")]
    if early:
        raise AssertionError(f"without forward prefetch, units {early} were all-gathered before the forward of the "
                             f"unit before each began (in order: {events}; the root is '')")


def prefetches_backward(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, config: WrapConfig) -> None:
    """``model`` (a fresh copy), every block holding parameters a unit under the root with the program's strategy and
    exposure: a second iteration's backward prefetches ([Note: prefetch as by default])."""
    blocks = [index for index, block in enumerate(model.blocks) if holds_parameters(block)]
    if len(blocks) < 2:
        return
    units = AutoWrap(kind="module_names", module_names=tuple(f"blocks.{index}" for index in blocks))
    wrapped = impl.wrap(model, WrapSpec(strategy=config.strategy, use_orig_params=config.use_orig_params,
                                        auto_wrap=units))
    batch = batch_of(config, 0, ctx.rank, ctx.device)
    loss_of(wrapped(batch)).backward()
    loss = loss_of(wrapped(batch))
    with ctx.record_collectives() as backward:
        loss.backward()
    assert_backward_prefetched([call for call in backward.calls if call.op in GATHERS + REDUCTIONS])
