"""Mutants the parity fuzzer must catch: mixed-precision training with the master weights broken."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from conformance.mutants._base import Expect, Patch, _Mutant

__all__ = ["MasterRoundedToParamDtype"]

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
