"""Memory mutants: correct training that holds what sharding should have freed."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["NeverReshard", "KeepFullGradients", "HooksHoldTheirUnit"]

Fn = Callable[..., Any]

_PEAK = Expect("peak_per_rank", "thread", ("memory/peak_per_rank",))


def _keeping_full_grad(issue: Fn) -> Fn:
    def issue_and_keep(unit: Any, grad: Any) -> Any:
        unit.handle.kept_full_grad = grad  # until this unit's next backward replaces it
        return issue(unit, grad)

    return issue_and_keep


class NeverReshard(_Mutant):
    """Resharding keeps the unsharded parameter's storage: every unit stays gathered after its first use."""

    name = "mutant-never-reshard"
    breaks = "freeing unsharded parameters (memory)"
    expect = _PEAK
    patches = (Patch.instead("fsdp_impl.flat_param:FlatParamHandle._free_storage", lambda self: None),)


class KeepFullGradients(_Mutant):
    """Reduce-scatters each unit's gradient but keeps the unsharded gradient alive as well."""

    name = "mutant-keep-full-gradients"
    breaks = "freeing unsharded gradients after their reduction (memory)"
    expect = _PEAK
    patches = (Patch("fsdp_impl.reduction:issue_reduction", _keeping_full_grad),)


class HooksHoldTheirUnit(_Mutant):
    """Each unit's gradient hooks hold it strongly: the unsharded flat parameter's hook keeps the whole model
    alive after the user drops it (a cycle through a tensor the collector cannot break)."""

    name = "mutant-hooks-hold-their-unit"
    breaks = "freeing a model its user dropped"
    expect = Expect("dropped_model_freed", "thread", ("memory/dropped_model_freed",))
    patches = (Patch.instead("fsdp_impl.unit:_bound_weakly", functools.partial),)
