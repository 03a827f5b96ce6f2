"""Mutants for ``fully_shard_options``: the reference's ``set_is_last_backward``, and, for what only torch's
``fully_shard`` has, torch-fsdp2 with the option accepted and dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["NotLastBackwardDropsReductions"]

Fn = Callable[..., Any]


def _drops_pending(final_callback: Fn) -> Fn:
    def end_of_backward(state: Any) -> None:
        if not all(unit.controls.is_last_backward for unit in state.units if unit.is_root):
            state.reductions.clear()  # the reductions left in flight are forgotten, not finished later
        final_callback(state)

    return end_of_backward


class NotLastBackwardDropsReductions(_Mutant):
    """A backward marked as not the last forgets the reductions it left in flight (the last units' gradients
    of that micro-batch never reach ``.grad``)."""

    name = "mutant-not-last-backward-drops-reductions"
    breaks = "finishing a non-last backward's reductions in a later backward"
    expect = Expect("is_last_backward", "thread", ("fully_shard_options/is_last_backward",))
    patches = (Patch("fsdp_impl.unit:_final_callback", _drops_pending),)
