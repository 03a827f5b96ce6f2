"""Mutants the fuzzers must catch: mixed-precision training with the master weights broken, buffers
rounded before the first forward, a ``fully_shard``-ed module's controls or settings broken, the gradient kept
inside ``no_sync`` reduced apart or kept in another dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import WrapSpec
from conformance.selftest.declare import Expect, Patch, _Mutant, drop_grads

__all__ = ["MasterRoundedToParamDtype", "AccumulatesInReduceDtype", "BuffersRoundedAtWrap", "UnshardWithoutGather",
           "GradSyncForgetsKeptGrads", "NoSyncReducesKeptApart", "NoSyncKeepsGradInReduceDtype",
           "IgnoresGradientDivideFactor", "ReshardsAfterForwardAnyway"]

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
        # rounded sum (torch FSDP1's NO_SHARD does this, see fuzz/repro_no_shard_low_precision_accumulation).
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
    expect = Expect("repro_no_shard_low_precision_accumulation", "thread",
                    ("fuzz/repro_no_shard_low_precision_accumulation",))
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.accumulate_sharded_grad", _add_in_reduce_dtype),)


class BuffersRoundedAtWrap(_Mutant):
    """With a ``buffer_dtype``, buffers take that dtype's values when the module is wrapped, before any
    forward (torch's FSDP1 does so at its first state dict, see fuzz/repro_buffer_dtype_state_dict_before_forward)."""

    name = "mutant-buffers-rounded-at-wrap"
    breaks = "keeping buffers as built until the first forward"
    expect = Expect("repro_buffer_dtype_state_dict_before_forward", "thread",
                    ("fuzz/repro_buffer_dtype_state_dict_before_forward",))

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        low = None if spec.mixed_precision is None else spec.mixed_precision.buffer_dtype
        if low is not None:
            with torch.no_grad():
                for buf in module.buffers():
                    if buf.is_floating_point():
                        buf.copy_(buf.to(low))
        return super().wrap(module, spec)


def _unshard_without_gather(_unshard: Fn) -> Fn:
    def unshard_without_gather(module: Any, async_op: bool = False) -> None:
        # Marks the parameters gathered without gathering them: the next forward computes on zeros.
        from fsdp_impl.api import ShardedState

        handle = module._own().handle
        if handle is not None and handle.state is ShardedState.SHARDED:
            handle._alloc_storage()
            with torch.no_grad():
                handle.full.data.zero_()
            handle.state = ShardedState.UNSHARDED
            handle.install_unsharded_views()
        return None

    return unshard_without_gather


#: The stateful fuzzer's fixed program of every fully_shard control.
_CONTROLS = Expect("fully_shard_controls", "thread", ("fuzz/fully_shard_controls",))


class UnshardWithoutGather(_Mutant):
    """``FSDPModule.unshard()`` allocates the module's unsharded parameters and marks them gathered
    without all-gathering them, so the forward that follows computes on zeros."""

    name = "mutant-unshard-without-gather"
    breaks = "filling the unsharded parameters on unshard()"
    expect = _CONTROLS
    patches = (Patch("fsdp_impl.fsdp_module:FSDPModule.unshard", _unshard_without_gather),)


def _forgetting_kept_grads(set_sync: Fn) -> Fn:
    def set_requires_gradient_sync_forgetting(module: Any, requires_gradient_sync: bool, *,
                                              recurse: bool = True) -> None:
        # Turning sync back on drops what the backwards without it kept.
        if requires_gradient_sync:
            for state in module._units(recurse):
                state.unsynced_grad = None
        set_sync(module, requires_gradient_sync, recurse=recurse)

    return set_requires_gradient_sync_forgetting


class GradSyncForgetsKeptGrads(_Mutant):
    """``set_requires_gradient_sync(True)`` forgets the gradients backwards kept while it was off: the
    next synchronizing backward reduces its own gradient only."""

    name = "mutant-grad-sync-forgets-kept-grads"
    breaks = "accumulating the gradients of backwards without gradient sync"
    expect = _CONTROLS
    patches = (Patch("fsdp_impl.fsdp_module:FSDPModule.set_requires_gradient_sync", _forgetting_kept_grads),)


def _reduce_kept_apart(add_kept: Fn) -> Fn:
    def reduce_kept_apart(unit: Any, grad: torch.Tensor) -> torch.Tensor:
        # The synchronizing backward reduces the kept gradient on its own, then its own gradient: two
        # reductions whose results add up in float32, where the sum should be rounded and reduced once.
        from fsdp_impl import reduction

        if unit.unsynced_grad is None or not unit.controls.requires_gradient_sync:
            return add_kept(unit, grad)  # type: ignore[no-any-return]
        kept, unit.unsynced_grad = unit.unsynced_grad, None
        reduction.finish_reductions(unit.root)
        unit.root.reductions.append(reduction.issue_reduction(unit, kept))
        return grad

    return reduce_kept_apart


class NoSyncReducesKeptApart(_Mutant):
    """The first backward after ``no_sync`` reduces the gradient kept inside it and its own separately and adds
    the reduced results in float32, instead of reducing their sum (rounded to ``param_dtype``) once."""

    name = "mutant-no-sync-reduces-kept-apart"
    breaks = "reducing the sum of the gradient kept inside no_sync and the synchronizing backward's once"
    expect = Expect("repro_no_sync_bf16_accumulation", "thread", ("fuzz/repro_no_sync_bf16_accumulation",))
    patches = (Patch("fsdp_impl.unit:_with_unsynced_grad", _reduce_kept_apart),)


def _widen_kept(add_kept: Fn) -> Fn:
    def add_kept_in_reduce_dtype(unit: Any, grad: torch.Tensor) -> torch.Tensor:
        # Widens the kept gradient to reduce_dtype before the next backward adds to it (as fully_shard does).
        policy = unit.config.low_precision(unit.training)
        if unit.unsynced_grad is not None and policy is not None and policy.reduce_dtype is not None:
            unit.unsynced_grad = unit.unsynced_grad.to(policy.reduce_dtype)
        return add_kept(unit, grad)  # type: ignore[no-any-return]

    return add_kept_in_reduce_dtype


class NoSyncKeepsGradInReduceDtype(_Mutant):
    """Inside ``no_sync`` the kept gradient adds up in ``reduce_dtype`` (float32) rather than in ``param_dtype``,
    the dtype of the module variables FSDP1's ``no_sync`` accumulates in (FSDP2's behaviour, see
    fuzz/repro_no_sync_float32_reduce_accumulation)."""

    name = "mutant-no-sync-keeps-grad-in-reduce-dtype"
    breaks = "accumulating the gradients kept inside no_sync in param_dtype"
    expect = Expect("repro_no_sync_float32_reduce_accumulation or unsynced_sums", "thread",
                    ("fuzz/repro_no_sync_float32_reduce_accumulation", "mixed_precision/unsynced_sums[api=wrap]"))
    patches = (Patch("fsdp_impl.unit:_with_unsynced_grad", _widen_kept),)


def _ignored(_setter: Fn) -> Fn:
    def ignored_setting(module: Any, *args: Any, **kwargs: Any) -> None:
        # Accepts the setting and changes nothing.
        return None

    return ignored_setting


class IgnoresGradientDivideFactor(_Mutant):
    """``set_gradient_divide_factor`` changes nothing: the module's gradients are still divided by the world
    size."""

    name = "mutant-ignores-gradient-divide-factor"
    breaks = "dividing a module's summed gradients by its divide factor"
    expect = Expect("gradient_divide_factor or divide_factor_one_rank", "thread",
                    ("fuzz/gradient_divide_factor", "fuzz/repro_divide_factor_one_rank"))
    patches = (Patch("fsdp_impl.fsdp_module:FSDPModule.set_gradient_divide_factor", _ignored),)


class ReshardsAfterForwardAnyway(_Mutant):
    """``set_reshard_after_forward(False)`` changes nothing: a module built to reshard after forward still does,
    and backward gathers it again."""

    name = "mutant-reshards-after-forward-anyway"
    breaks = "keeping the unsharded parameters after forward once set_reshard_after_forward(False)"
    expect = Expect("set_reshard_after_forward", "process", ("fuzz/set_reshard_after_forward",))
    patches = (Patch("fsdp_impl.fsdp_module:FSDPModule.set_reshard_after_forward", _ignored),)
