"""Gradient-accumulation mutants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.mutants._base import Expect, Patch, _Mutant, drop_grads

__all__ = ["OffloadedAccumulationOverwrites"]

Fn = Callable[..., Any]


def _overwrite_when_offloaded(accumulate: Fn) -> Fn:
    def accumulate_or_replace(handle: Any, grad: Any) -> None:
        if handle.offload_params:
            drop_grads(handle)
        accumulate(handle, grad)

    return accumulate_or_replace


class OffloadedAccumulationOverwrites(_Mutant):
    """With parameter CPU offload, each backward's gradient replaces the CPU gradient instead of adding to it."""

    name = "mutant-offloaded-accumulation-overwrites"
    breaks = "accumulating gradients of CPU-offloaded parameters across backwards"
    expect = Expect(
        "grad_accumulation", "thread", ("grad_accumulation/accumulate[cpu_offload=True]",),
    )
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.accumulate_sharded_grad", _overwrite_when_offloaded),)
