"""Parameter exposures: the ``use_orig_params`` values a behaviour row runs, per implementation.

[Note: parameter exposures]
FSDP1 offers two ways to expose a unit's parameters: the original parameters
(``use_orig_params=True``) and one flat parameter per unit (``False``);
FSDP2-like and per-parameter designs expose only the original ones (as
DTensors). Training with activation checkpointing, loading a state dict
mid-loop, uneven shards and hybrid sharding are behaviours of every FSDP, so
their rows are not split by exposure (a split would make every such row n/a
for an implementation that has no flat parameter, for a mechanism it does not
use). Instead a row runs its body once per exposure the implementation
offers, :func:`parameter_exposures`, and a failure names the exposure it ran
under (:func:`under_exposure`). The case declares ``uses=[Capability.FLAT_PARAM]``
so that the flat-parameter pass may wrap with ``use_orig_params=False``.
Rows that test the flat parameter itself keep requiring ``FLAT_PARAM``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from conformance.contract.adapter import Capability
from conformance.contract.optional import capabilities_of

__all__ = ["parameter_exposures", "under_exposure"]


def parameter_exposures(adapter: Any) -> tuple[bool, ...]:
    """``(True,)``, or ``(True, False)`` for an adapter declaring :attr:`Capability.FLAT_PARAM`
    ([Note: parameter exposures])."""
    return (True, False) if Capability.FLAT_PARAM in capabilities_of(adapter) else (True,)


@contextmanager
def under_exposure(use_orig_params: bool) -> Iterator[None]:
    """An assertion failing inside is re-raised prefixed with ``use_orig_params=<value>``; any other
    exception keeps its type and gains a note saying the exposure (shown with its traceback)."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"use_orig_params={use_orig_params}: {exc}") from exc
    except Exception as exc:
        exc.add_note(f"(raised under use_orig_params={use_orig_params})")
        raise
