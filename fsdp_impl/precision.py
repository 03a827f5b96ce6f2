"""What a forward does to dtypes and devices around the units: inputs, outputs, buffers, gather dtype.

The policy itself is [Note: mixed precision] in ``flat_param.py``; this module
applies it at the module boundary. The root moves tensor inputs to its
compute device and sets, for every unit under it, the dtype its next
all-gather uses and the dtype of the root's buffers. A unit casts its floating
inputs to its ``param_dtype`` when its policy says so (``cast_forward_inputs``
for every unit, ``cast_root_forward_inputs`` for the root: the wrapper's default
is the root only, ``fully_shard``'s every unit), and casts its floating outputs
to ``output_dtype`` (``fully_shard``'s ``MixedPrecisionPolicy``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from fsdp_impl.unit_state import RootState, UnitState

__all__ = ["to_device", "cast_floating", "cast_inputs", "set_root_precision"]


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor on ``device``."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x, tree)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """``tree`` with its floating tensors cast to ``dtype`` (unchanged when None)."""
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def cast_inputs(unit: UnitState, inputs: Any) -> Any:
    """``inputs`` as ``unit`` computes on them: floating ones in its ``param_dtype`` if it casts."""
    policy = unit.config.low_precision(unit.training)
    if policy is None or not (policy.cast_forward_inputs or (unit.is_root and policy.cast_root_forward_inputs)):
        return inputs
    return cast_floating(inputs, policy.param_dtype)


def set_root_precision(root: UnitState, state: RootState) -> None:
    """Before the root's forward: every unit gathers in its param dtype or in full precision (eval
    with ``use_full_prec_in_eval``), buffers take the buffer dtype or their own."""
    for unit in state.units:
        if unit.handle is not None:
            unit.handle.set_full_precision(unit.config.low_precision(unit.training) is None)
    policy = root.config.low_precision(root.training)
    for name, buf in root.module.named_buffers():
        want = state.buffer_dtypes.get(name, buf.dtype)
        if policy is not None and policy.buffer_dtype is not None and buf.is_floating_point():
            want = policy.buffer_dtype
        if buf.dtype != want:
            buf.data = buf.data.to(want)
