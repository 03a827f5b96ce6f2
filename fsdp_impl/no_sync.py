"""The root's ``no_sync()`` context: backwards inside it accumulate gradients without communicating.

What a backward does inside it is [Note: no_sync] in :mod:`fsdp_impl.unit`; this
module only checks where the context may be entered and turns off
``UnitControls.requires_gradient_sync`` of every unit under the root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from fsdp_impl import unit
from fsdp_impl.api import TrainingState
from fsdp_impl.unit_state import unit_state

__all__ = ["no_sync"]

#: torch's FSDP1 wording, for a unit that is not the root.
INNER_UNIT_MESSAGE = (
    "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on root FSDP module."
)


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Inside: no backward reduces; the first backward after it reduces everything accumulated.

    Only on the root (RuntimeError, worded as torch's FSDP1), and only between
    iterations (ValueError naming the phase the root is in). Like torch's, it
    runs lazy init, so called before the first forward it makes ``module`` the
    root. Nesting is allowed: leaving an inner context keeps the outer one's.
    """
    state = unit_state(module)
    if state is None:
        raise TypeError(f"no_sync() needs an FSDP unit, got {type(module).__name__}")
    if state.root is None:
        unit.lazy_init(module)
    if not state.is_root:
        raise RuntimeError(INNER_UNIT_MESSAGE)
    backward = unit.in_backward()
    if state.training_state is not TrainingState.IDLE or backward:
        raise ValueError(
            f"no_sync() must be entered between iterations: expected to be in states "
            f"{[TrainingState.IDLE]} but current state is {state.training_state}"
            + (" (inside a backward)" if backward else "")
        )
    root = state.root
    assert root is not None
    previous = [u.controls.requires_gradient_sync for u in root.units]
    for u in root.units:
        u.controls.requires_gradient_sync = False
    try:
        yield
    finally:
        for u, sync in zip(root.units, previous, strict=True):
            u.controls.requires_gradient_sync = sync
