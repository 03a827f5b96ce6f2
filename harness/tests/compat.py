"""Collective names that differ across the torch releases the project supports, for the harness tests.

Newer torch names the tensor-in/tensor-out collectives ``all_gather_single``
and ``reduce_scatter_single``; older releases have only
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (same arguments).
Code that must run on every supported torch calls these helpers, which look
the name up on ``torch.distributed`` when called (so a recorder or fault
injector patching either name still sees the call) and never assume the
newer one exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["resolve_collective", "all_gather_single", "reduce_scatter_single"]

_FALLBACK = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def resolve_collective(name: str) -> Callable[..., Any]:
    """``torch.distributed.<name>``, or its older equivalent when this torch lacks it."""
    if name not in _FALLBACK:
        raise ValueError(f"no compatibility entry for {name!r}; known: {sorted(_FALLBACK)}")
    found = getattr(dist, name, None)
    if found is None:
        found = getattr(dist, _FALLBACK[name])
    return found


def all_gather_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """Gather every rank's ``input`` into ``output`` (rank order); keywords as torch's."""
    return resolve_collective("all_gather_single")(output, input, **kwargs)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """Reduce ``input`` over the ranks and keep this rank's piece in ``output``; keywords as torch's."""
    return resolve_collective("reduce_scatter_single")(output, input, **kwargs)
