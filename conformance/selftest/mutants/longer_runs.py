"""Mutants that behave correctly for the first iterations and break later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["WarnsEveryIteration", "FinalReshardStopsAfterFourIterations"]

Fn = Callable[..., Any]


def _next_iter_still_warning(next_iter: Fn) -> Fn:
    def next_iter_keeping_warn_status(data: Any) -> None:
        status = data.warn_status
        next_iter(data)
        data.warn_status = status

    return next_iter_keeping_warn_status


class WarnsEveryIteration(_Mutant):
    """After a forward-order change, warns again in every later iteration instead of once."""

    name = "mutant-warns-every-iteration"
    breaks = "warning once about a changed forward order, then training on quietly"
    expect = Expect("invalid_later_iter_order", "thread", ("exec_order/invalid_later_iter_order",))
    patches = (Patch("fsdp_impl.exec_order:ExecOrderData.next_iter", _next_iter_still_warning),)


#: The first iteration (0-based) whose end-of-backward reshard is skipped.
_BROKEN_FROM = 4
_skipping = threading.local()  # thread ranks run their callbacks concurrently


def _final_callback_tiring(final_callback: Fn) -> Fn:
    def final_callback_skipping_late(state: Any) -> None:
        _skipping.active = state.exec_order.iteration >= _BROKEN_FROM
        try:
            final_callback(state)
        finally:
            _skipping.active = False

    return final_callback_skipping_late


def _reshard_unless_skipping(reshard: Fn) -> Fn:
    def reshard_checked(handle: Any) -> None:
        if not getattr(_skipping, "active", False):
            reshard(handle)

    return reshard_checked


class FinalReshardStopsAfterFourIterations(_Mutant):
    """From the fifth iteration on, the end-of-backward callback leaves unused units unsharded."""

    name = "mutant-final-reshard-stops-after-four-iterations"
    breaks = "resharding at the end of backward in longer runs"
    expect = Expect("unused_outputs_resharded", "thread", ("unit_outputs/unused_outputs_resharded",))
    patches = (
        Patch("fsdp_impl.flat_param:FlatParamHandle.reshard", _reshard_unless_skipping),
        Patch("fsdp_impl.unit:_final_callback", _final_callback_tiring),
    )
