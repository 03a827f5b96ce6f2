"""Mutants about gathering parameters again for backward through a unit's outputs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["NoRegatherBeforeBackward"]

Fn = Callable[..., Any]
_in_pre_backward = threading.local()  # thread ranks run their hooks concurrently


def _flag_pre_backward(pre_backward: Fn) -> Fn:
    def pre_backward_flagged(unit: Any, grad: Any) -> None:
        _in_pre_backward.active = True
        try:
            pre_backward(unit, grad)
        finally:
            _in_pre_backward.active = False

    return pre_backward_flagged


def _unshard_outside_pre_backward(unshard_now: Fn) -> Fn:
    def unshard_unless_pre_backward(unit: Any, state: Any) -> None:
        if not getattr(_in_pre_backward, "active", False):
            unshard_now(unit, state)

    return unshard_unless_pre_backward


class NoRegatherBeforeBackward(_Mutant):
    """A unit resharded after forward is not gathered again when its outputs' gradients arrive."""

    name = "mutant-no-regather-before-backward"
    breaks = "gathering a resharded unit's parameters again for its backward"
    expect = Expect("unit_outputs", "thread", ("unit_outputs/caller_use",))
    patches = (
        Patch("fsdp_impl.unit:_unshard_now", _unshard_outside_pre_backward),
        Patch("fsdp_impl.unit:_pre_backward_hook", _flag_pre_backward),
    )
