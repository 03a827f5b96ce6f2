"""Training-time mutants: gradient reduction, resharding, recomputation, prefetch, hooks."""

from __future__ import annotations

from typing import Any

from conformance.mutants._base import _Mutant, patch_once

__all__ = [
    "NoGradDivide",
    "WrongReplicateGroup",
    "NoReshardAfterBackward",
    "NoRegatherForRecompute",
    "NoPrefetch",
    "AlwaysPrefetch",
    "HooksOnPlainTensorOutputsOnly",
    "ZeroGradForUnused",
    "FirstGradPieceOnly",
    "NoNestedBackwardGuard",
    "OffloadedGradsDropped",
]


class NoGradDivide(_Mutant):
    """Sums gradients across ranks but never divides by the data-parallel world size."""

    name = "mutant-no-grad-divide"
    breaks = "gradient averaging"

    def _mutate_unit(self, unit: Any) -> None:
        unit._dp_world_size = 1


class WrongReplicateGroup(_Mutant):
    """Hybrid units all-reduce over the shard group instead of the replicate group."""

    name = "mutant-wrong-replicate-group"
    breaks = "hybrid replicate all-reduce group"

    def _mutate_unit(self, unit: Any) -> None:
        if unit._inter_node_pg is not None:
            unit._replicate_group = unit._shard_group
            unit._inter_node_pg = unit._shard_group


class NoReshardAfterBackward(_Mutant):
    """The end-of-backward callback leaves units unsharded (e.g. ones whose output was unused)."""

    name = "mutant-no-reshard-after-backward"
    breaks = "resharding at the end of backward"

    def _patch_globally(self) -> None:
        import threading

        import fsdp_impl.unit as unit_mod
        from fsdp_impl.flat_param import FlatParamHandle

        final_callback, reshard = unit_mod._final_callback, FlatParamHandle.reshard
        in_final = threading.local()  # thread ranks run their callbacks concurrently

        def final_callback_without_reshard(state: Any) -> None:
            in_final.active = True
            try:
                final_callback(state)
            finally:
                in_final.active = False

        def reshard_outside_final_callback(handle: Any) -> None:
            if not getattr(in_final, "active", False):
                reshard(handle)

        patch_once(FlatParamHandle, "reshard", reshard_outside_final_callback)
        patch_once(unit_mod, "_final_callback", final_callback_without_reshard)


class NoRegatherForRecompute(_Mutant):
    """Recomputing a checkpointed forward inside backward reuses whatever parameter storage is there."""

    name = "mutant-no-regather-for-recompute"
    breaks = "unsharding before activation-checkpoint recomputation"

    def _patch_globally(self) -> None:
        import fsdp_impl.unit as unit_mod

        pre_forward = unit_mod._pre_forward

        def pre_forward_without_regather(unit: Any, state: Any, recompute: bool) -> None:
            if not recompute:
                pre_forward(unit, state, recompute)

        patch_once(unit_mod, "_pre_forward", pre_forward_without_regather)


class NoPrefetch(_Mutant):
    """Ignores forward/backward prefetch requests: every all-gather is issued when its unit runs."""

    name = "mutant-no-prefetch"
    breaks = "prefetching (communication/compute overlap)"
    spec_overrides = {"forward_prefetch": False, "backward_prefetch": None}


class AlwaysPrefetch(_Mutant):
    """Prefetches even when forward/backward prefetch are turned off (the user's memory limit is ignored)."""

    name = "mutant-always-prefetch"
    breaks = "turning prefetch off"
    spec_overrides = {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"}


class HooksOnPlainTensorOutputsOnly(_Mutant):
    """Registers backward hooks only when a unit returns a bare tensor (not tuples, namedtuples)."""

    name = "mutant-hooks-on-plain-outputs-only"
    breaks = "pre-backward hooks on every tensor of structured outputs"

    def _patch_globally(self) -> None:
        import torch

        import fsdp_impl.unit as unit_mod

        def plain_tensors_only(tree: Any, is_leaf: Any = None) -> Any:
            return ([tree] if isinstance(tree, torch.Tensor) else [], None)

        unit_mod.tree_flatten = plain_tensors_only  # type: ignore[assignment]


class ZeroGradForUnused(_Mutant):
    """Gives units that took no part in the loss a zero gradient instead of ``None``."""

    name = "mutant-zero-grad-for-unused"
    breaks = "grad None for parameters unused in forward"

    def _patch_globally(self) -> None:
        import torch

        import fsdp_impl.unit as unit_mod

        final = unit_mod._final_callback

        def final_with_zero_grads(state: Any) -> None:
            final(state)
            for unit in state.units:
                handle = unit._handle
                if handle is not None and handle.sharded_grad() is None:
                    handle.accumulate_sharded_grad(torch.zeros_like(handle.flat_param))

        patch_once(unit_mod, "_final_callback", final_with_zero_grads)


class FirstGradPieceOnly(_Mutant):
    """Reduces only the first gradient a unit's flat parameter accumulates per backward."""

    name = "mutant-first-grad-piece-only"
    breaks = "reducing every gradient piece a unit receives in one backward"

    def _patch_globally(self) -> None:
        import fsdp_impl.unit as unit_mod

        post_backward = unit_mod._post_backward_hook
        final = unit_mod._final_callback

        def post_backward_once(unit: Any, full: Any) -> None:
            if getattr(unit, "_mutant_reduced", False):
                full.grad = None
                return
            if full.grad is not None:
                unit._mutant_reduced = True
            post_backward(unit, full)

        def final_clearing(state: Any) -> None:
            final(state)
            for unit in state.units:
                unit._mutant_reduced = False

        patch_once(unit_mod, "_post_backward_hook", post_backward_once)
        patch_once(unit_mod, "_final_callback", final_clearing)


class NoNestedBackwardGuard(_Mutant):
    """Reshards a unit after the first gradient piece even when a nested (reentrant) backward delivered it."""

    name = "mutant-no-nested-backward-guard"
    breaks = "keeping parameters for the outer backward after a reentrant checkpoint's nested backward"

    def _patch_globally(self) -> None:
        import torch

        import fsdp_impl.unit as unit_mod

        post_backward = unit_mod._post_backward_hook

        def post_backward_in_outer_task(unit: Any, full: Any) -> None:
            unit._backward_task = torch._C._current_graph_task_id()
            post_backward(unit, full)

        patch_once(unit_mod, "_post_backward_hook", post_backward_in_outer_task)


class OffloadedGradsDropped(_Mutant):
    """With parameter CPU offload, reduced gradients never reach the offloaded parameters."""

    name = "mutant-offloaded-grads-dropped"
    breaks = "gradients of CPU-offloaded parameters"

    def _patch_globally(self) -> None:
        from fsdp_impl.flat_param import FlatParamHandle

        accumulate = FlatParamHandle.accumulate_sharded_grad

        def accumulate_unless_offloaded(handle: Any, grad: Any) -> None:
            if not handle.offload_params:
                accumulate(handle, grad)

        patch_once(FlatParamHandle, "accumulate_sharded_grad", accumulate_unless_offloaded)
