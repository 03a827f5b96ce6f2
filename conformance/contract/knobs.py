"""Performance knobs as optional adapter methods: the functions :mod:`conformance.contract.optional` exports
(its table gives each default), defined here by family. A knob changes how an implementation runs, never a
value a user can read ([Note: performance knobs] in :mod:`conformance.cases.test_neutrality`)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from conformance.contract.adapter import WrapSpec

__all__ = ["knob_specs", "performance_knobs", "set_performance_knob", "wrap_knobs"]


def performance_knobs(adapter: Any) -> frozenset[str]:
    """The names of the performance knobs the adapter turns on itself, after a wrap ([Note: performance knobs]
    in :mod:`conformance.cases.test_neutrality`, which lists every name a row exists for); none by default."""
    knobs: Any = getattr(adapter, "performance_knobs", frozenset())
    if not isinstance(knobs, (set, frozenset)) or not all(isinstance(knob, str) for knob in knobs):
        raise TypeError(f"adapter {getattr(adapter, 'name', adapter)!r}: performance_knobs must be a set of "
                        f"knob names, got {knobs!r}")
    return frozenset(knobs)


def set_performance_knob(adapter: Any, model: nn.Module, knob: str) -> None:
    """Turn ``knob`` (one of :func:`performance_knobs`) on for every unit of the wrapped ``model``."""
    if knob not in performance_knobs(adapter):
        raise ValueError(f"adapter {getattr(adapter, 'name', adapter)!r} offers no performance knob {knob!r}")
    adapter.set_performance_knob(model, knob)


def wrap_knobs(adapter: Any) -> frozenset[str]:
    """The names of the performance knobs the adapter turns on while wrapping, a construction option
    (:func:`knob_specs`); none by default."""
    knobs: Any = getattr(adapter, "wrap_knobs", frozenset())
    if not isinstance(knobs, (set, frozenset)) or not all(isinstance(knob, str) for knob in knobs):
        raise TypeError(f"adapter {getattr(adapter, 'name', adapter)!r}: wrap_knobs must be a set of knob names, "
                        f"got {knobs!r}")
    return frozenset(knobs)


def knob_specs(adapter: Any, base: WrapSpec, knob: str) -> tuple[WrapSpec, WrapSpec]:
    """``base`` with ``knob`` (one of :func:`wrap_knobs`) off and on: what the two models of a neutrality row are
    wrapped with (the knob may need other options, set alike in both, such as ``cpu_offload``)."""
    if knob not in wrap_knobs(adapter):
        raise ValueError(f"adapter {getattr(adapter, 'name', adapter)!r} offers no wrap-time knob {knob!r}")
    off, on = adapter.knob_specs(base, knob)
    return off, on
