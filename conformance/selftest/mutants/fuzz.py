"""Mutants the fuzzers must catch: mixed-precision training with the master weights broken, buffers
rounded before the first forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import WrapSpec
from conformance.selftest.declare import Expect, Patch, _Mutant, drop_grads

__all__ = ["MasterRoundedToParamDtype", "AccumulatesInReduceDtype", "BuffersRoundedAtWrap"]

Fn = Callable[..., Any]


def _round_master_first(start_unshard: Fn) -> Fn:
    def start_unshard_rounding_master(handle: Any) -> None:
        # Writes the low-precision copy back into the float32 shard (the optimizer's master weights).
        low = handle.full.dtype
        if handle.flat_param.dtype != low and handle.state.name == "SHARDED":
            with torch.no_grad():
                handle.flat_param.data.copy_(handle.flat_param.data.to(low))
        start_unshard(handle)

    return start_unshard_rounding_master


class MasterRoundedToParamDtype(_Mutant):
    """Under a mixed-precision policy each all-gather rounds the sharded float32 parameters to
    ``param_dtype`` in place: the optimizer's master weights lose their low bits every step."""

    name = "mutant-master-rounded-to-param-dtype"
    breaks = "keeping the sharded parameters in full precision under mixed precision"
    #: The fuzzer draws a policy for about a third of its examples; world size 2 draws 15.
    expect = Expect("parity_ws2", "process", ("fuzz/parity_ws2",))
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.start_unshard", _round_master_first),)


def _add_in_reduce_dtype(accumulate: Fn) -> Fn:
    def accumulate_in_reduce_dtype(handle: Any, grad: torch.Tensor) -> None:
        # Adds the new reduced gradient to the kept one in the reduction's dtype, then stores the
        # rounded sum (torch FSDP1's NO_SHARD does this, see fuzz/repro_57555c45).
        previous = handle.sharded_grad()
        if previous is None or previous.dtype == grad.dtype:
            accumulate(handle, grad)
            return
        summed = previous.to(grad.dtype) + grad
        drop_grads(handle)
        accumulate(handle, summed)

    return accumulate_in_reduce_dtype


class AccumulatesInReduceDtype(_Mutant):
    """With a low-precision reduction, a second backward's gradient is added to the first in that
    dtype (bfloat16) instead of in the parameters' float32."""

    name = "mutant-accumulates-in-reduce-dtype"
    breaks = "accumulating gradients across backwards in the parameters' dtype"
    expect = Expect("repro_57555c45", "thread", ("fuzz/repro_57555c45",))
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.accumulate_sharded_grad", _add_in_reduce_dtype),)


class BuffersRoundedAtWrap(_Mutant):
    """With a ``buffer_dtype``, buffers take that dtype's values when the module is wrapped, before any
    forward (torch's FSDP1 does so at its first state dict, see fuzz/repro_6ec378a7)."""

    name = "mutant-buffers-rounded-at-wrap"
    breaks = "keeping buffers as built until the first forward"
    expect = Expect("repro_6ec378a7", "thread", ("fuzz/repro_6ec378a7",))

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        low = None if spec.mixed_precision is None else spec.mixed_precision.buffer_dtype
        if low is not None:
            with torch.no_grad():
                for buf in module.buffers():
                    if buf.is_floating_point():
                        buf.copy_(buf.to(low))
        return super().wrap(module, spec)
