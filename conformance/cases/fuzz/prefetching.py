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
:mod:`conformance.cases.fuzz.held`); the check is made only where no two units
share such a size (else an all-gather could be either), counts the all-gathers
over the whole world only (an int ``reshard_after_forward`` gathers backward's
over smaller groups, with smaller pieces), and leaves out an all-gather of
another size (an implementation padding another way is not judged). Forward
lists are emptied before the backward: a checkpointed block's recomputation is a
forward inside backward, where the forward lists are not what is checked.
``reshard/explicit_prefetch`` checks the same contract on its own model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.cases.fuzz.controls import _at, shard_config
from conformance.cases.fuzz.held import shard_sizes, units_of
from conformance.cases.fuzz.model import FuzzModel, loss_of
from conformance.cases.fuzz.ops import Config
from conformance.cases.fuzz.shadow import batch_of
from conformance.contract.adapter import FSDPAdapter
from conformance.contract.optional import set_modules_to_prefetch
from harness.recorder import Call

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["prefetches_in_order"]

_GATHERS = ("all_gather_into_tensor", "all_gather")
_LISTED = 2  # units in each list


def prefetches_in_order(ctx: RankContext, impl: FSDPAdapter, model: FuzzModel, local: FuzzModel,
                        config: Config) -> None:
    """``model`` (a fresh copy; ``local``, another, unsharded) sharded as ``config`` says, with every unit's
    prefetch lists the next two units: each pass all-gathers the units in order (see the note)."""
    spans = _spans(local, config)
    if spans is None:
        return
    sharded = shard_config(ctx, impl, model, config)
    forward = list(spans)
    backward = forward[:1] + forward[:0:-1]
    modules = {path: _at(sharded, path) for path in forward}
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


def _spans(local: FuzzModel, config: Config) -> dict[str, frozenset[int]] | None:
    """Each unit with parameters, in forward order -> the bytes a rank may send to its all-gather; ``None``
    where two units may send as many (see the note)."""
    units = units_of(local, config)
    spans = {path: frozenset(shard_sizes(units[path], config.world_size)) for path in config.units() if path in units}
    sizes = [size for candidates in spans.values() for size in candidates]
    if len(spans) <= _LISTED or len(sizes) != len(set(sizes)):
        return None
    return spans


def _gathered(calls: list[Call], spans: dict[str, frozenset[int]], world: int) -> list[str]:
    """The units the whole-world all-gathers of ``calls`` gathered, each at its first, in issue order."""
    order: list[str] = []
    for call in calls:
        if call.op not in _GATHERS or len(call.group_ranks) != world:
            continue
        unit = next((path for path, sizes in spans.items() if call.bytes in sizes), None)
        if unit is not None and unit not in order:  # one of no unit's size gathers something else
            order.append(unit)
    return order


def _in_order(gathered: list[str], order: list[str], what: str) -> None:
    """``gathered`` follows ``order`` (units it skipped aside)."""
    expected = [path for path in order if path in gathered]
    if gathered != expected:
        names = [path or "<root>" for path in gathered]
        raise AssertionError(f"with prefetch lists of the next {_LISTED} units in {what} order, {what} all-gathered "
                             f"the units in the order {names}, not {[path or '<root>' for path in expected]}")
