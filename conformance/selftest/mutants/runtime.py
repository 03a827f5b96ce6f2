"""Training-time mutants: gradient reduction, resharding, recomputation, prefetch, hooks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from conformance.selftest.declare import Expect, Patch, _Mutant, _state_of, drop_grads

__all__ = [
    "UserHooksSkipped",
    "PostAccumulateGradHooksSkipped",
    "NoGradDivide",
    "WrongReplicateGroup",
    "NoReshardAfterBackward",
    "NoRegatherForRecompute",
    "NoPrefetch",
    "NoBackwardPrefetch",
    "AlwaysPrefetch",
    "ForwardPrefetchGathersOwnShard",
    "HooksOnPlainTensorOutputsOnly",
    "ZeroGradForUnused",
    "FirstGradPieceOnly",
    "NoNestedBackwardGuard",
    "OffloadedGradsDropped",
    "AccumulationOverwrites",
]

Fn = Callable[..., Any]

#: A reentrant checkpoint's nested backward hands a unit its gradient in pieces.
#: And the stateful fuzzer's smallest program with a reentrant block ([Note: reentrant blocks]).
_REENTRANT_CHECKPOINT = Expect(
    "checkpoint_submodule or repro_reentrant_checkpoint_root_params", "thread",
    ("checkpoint/checkpoint_submodule[use_reentrant=True]", "fuzz/repro_reentrant_checkpoint_root_params"),
)


class NoGradDivide(_Mutant):
    """Sums gradients across ranks but never divides by the data-parallel world size."""

    name = "mutant-no-grad-divide"
    breaks = "gradient averaging"
    # Adam is invariant to a uniform gradient scale: only the SGD rows of DDP parity see this.
    # And the stateful fuzzer at world sizes 2 and 4 with the main job's budget (seed 0): its first programs train.
    expect = Expect(
        "not_all_outputs_used_in_loss or (cpu_training_parity_vs_ddp and SGD) "
        "or repro_summon_grads_float64_padding_shard or stateful_ws2 or stateful_ws4 or root_outputs", "thread",
        ("unit_outputs/not_all_outputs_used_in_loss", "unit_outputs/root_outputs",
         "training/cpu_training_parity_vs_ddp[optim=SGD]",
         "fuzz/repro_summon_grads_float64_padding_shard", "fuzz/stateful_ws2", "fuzz/stateful_ws4"),
    )

    def _mutate_unit(self, unit: Any) -> None:
        _state_of(unit).groups.dp_world_size = 1


class WrongReplicateGroup(_Mutant):
    """Hybrid units all-reduce over the shard group instead of the replicate group."""

    name = "mutant-wrong-replicate-group"
    breaks = "hybrid replicate all-reduce group"
    expect = Expect(
        "HYBRID and (cpu_training_parity_vs_ddp or basic_setup or parity_with_fsdp)", "thread",
        ("training/cpu_training_parity_vs_ddp[strategy=HYBRID_SHARD]",
         "training/cpu_training_parity_vs_ddp[strategy=_HYBRID_SHARD_ZERO2]",
         "hybrid_shard/basic_setup", "hybrid_shard/parity_with_fsdp"),
    )

    def _mutate_unit(self, unit: Any) -> None:
        groups = _state_of(unit).groups
        if groups.inter_node_pg is not None:
            groups.replicate_group = groups.shard_group
            groups.inter_node_pg = groups.shard_group


_in_final_callback = threading.local()  # thread ranks run their callbacks concurrently


def _flag_final_callback(final_callback: Fn) -> Fn:
    def final_callback_flagged(state: Any) -> None:
        _in_final_callback.active = True
        try:
            final_callback(state)
        finally:
            _in_final_callback.active = False

    return final_callback_flagged


def _reshard_outside_final_callback(reshard: Fn) -> Fn:
    def reshard_unless_in_final_callback(handle: Any) -> None:
        if not getattr(_in_final_callback, "active", False):
            reshard(handle)

    return reshard_unless_in_final_callback


class NoReshardAfterBackward(_Mutant):
    """The end-of-backward callback leaves units unsharded (e.g. ones whose output was unused)."""

    name = "mutant-no-reshard-after-backward"
    breaks = "resharding at the end of backward"
    #: The fuzzer's reproducer: an unused unit's original parameters must be registered again.
    expect = Expect(
        "unused_outputs_resharded or repro_no_shard_unused_unit_params", "thread",
        ("unit_outputs/unused_outputs_resharded", "fuzz/repro_no_shard_unused_unit_params"),
    )
    patches = (
        Patch("fsdp_impl.flat_param:FlatParamHandle.reshard", _reshard_outside_final_callback),
        Patch("fsdp_impl.unit:_final_callback", _flag_final_callback),
    )


def _pre_forward_without_regather(pre_forward: Fn) -> Fn:
    def pre_forward_unless_recompute(unit: Any, state: Any, recompute: bool) -> None:
        if not recompute:
            pre_forward(unit, state, recompute)

    return pre_forward_unless_recompute


class NoRegatherForRecompute(_Mutant):
    """Recomputing a checkpointed forward inside backward reuses whatever parameter storage is there."""

    name = "mutant-no-regather-for-recompute"
    breaks = "unsharding before activation-checkpoint recomputation"
    # Recomputation runs a unit's forward inside backward: caught where units were freed
    # after forward (nested under a root) and the wrapper recomputes (checkpoint, not
    # offload: offload_activations=False).
    expect = Expect(
        "basic_checkpoint_end_to_end or checkpoint_fsdp_wrapping", "thread",
        ("checkpoint/basic_checkpoint_end_to_end",
         "checkpoint/checkpoint_fsdp_wrapping[nesting=under_root,offload_activations=False]"),
    )
    patches = (Patch("fsdp_impl.unit:_pre_forward", _pre_forward_without_regather),)


class NoPrefetch(_Mutant):
    """Ignores forward/backward prefetch requests: every all-gather is issued when its unit runs."""

    name = "mutant-no-prefetch"
    breaks = "prefetching (communication/compute overlap)"
    # The timing case's negative control: the same model without prefetch exceeds the bound.
    # One timed pass: the forward comes to about 1.2x its bound, jitter is under 1 %.
    expect = Expect("training_overlap", "process", ("overlap/training_overlap",), timing_repeats=1)
    spec_overrides = {"forward_prefetch": False, "backward_prefetch": None}


class NoBackwardPrefetch(_Mutant):
    """Prefetches in forward only: every backward all-gather is issued when its unit's backward runs."""

    name = "mutant-no-backward-prefetch"
    breaks = "backward prefetching (communication/compute overlap in backward)"
    # The forward stays within its bound: only the forward+backward bound can catch this, which
    # proves that bound can fail (the no-prefetch control times the forward only). One timed
    # pass: forward+backward comes to about 1.14x its bound.
    expect = Expect("training_overlap", "process", ("overlap/training_overlap",), timing_repeats=1)
    spec_overrides = {"backward_prefetch": None}


class AlwaysPrefetch(_Mutant):
    """Prefetches even when forward/backward prefetch are turned off (the user's memory limit is ignored)."""

    name = "mutant-always-prefetch"
    breaks = "turning prefetch off"
    # ... and the control itself fails for an implementation that prefetches when told not to.
    # The forward must come *under* its bound (about 0.98x): the default median of repeats.
    expect = Expect("no_overlap_detected", "process", ("overlap/no_overlap_detected",))
    spec_overrides = {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"}


def _own_shard_in_forward(prefetch_next: Fn) -> Fn:
    def prefetch_next_own_shard(unit: Any, state: Any, explicit: Any, recorded: Any) -> None:
        prefetch_next(unit, state, explicit, recorded)
        if unit.training_state.name != "FORWARD":
            return
        for target in explicit if explicit is not None else [recorded]:
            handle = None if target is None else target.handle
            if handle is None or handle.state.name != "UNSHARDING" or handle.shard_size == 1:
                continue
            handle.wait_unshard()
            shard = handle.flat_param.data.to(handle.full.device, handle.full.dtype)
            handle.full.data.copy_(shard.repeat(handle.shard_size)[: handle.full.numel()])

    return prefetch_next_own_shard


class ForwardPrefetchGathersOwnShard(_Mutant):
    """A unit prefetched in forward is filled from this rank's own shard, repeated, instead of every rank's: the
    all-gather a ``forward_prefetch`` issues computes on the wrong parameters (the on-demand gather is right)."""

    name = "mutant-forward-prefetch-gathers-own-shard"
    breaks = "forward prefetch changing no value (a prefetched all-gather gathers what an on-demand one does)"
    expect = Expect("neutrality", "process", ("neutrality/knob[knob=forward_prefetch]",))
    patches = (Patch("fsdp_impl.unit:_prefetch_next", _own_shard_in_forward),)


def _plain_tensors_only(tree: Any, is_leaf: Any = None) -> Any:
    return ([tree] if isinstance(tree, torch.Tensor) else [], None)


class HooksOnPlainTensorOutputsOnly(_Mutant):
    """Registers backward hooks only when a unit returns a bare tensor (not tuples, namedtuples)."""

    name = "mutant-hooks-on-plain-outputs-only"
    breaks = "pre-backward hooks on every tensor of structured outputs"
    expect = Expect(
        "structured_outputs or (caller_use and (container or namedtuple))", "thread",
        ("unit_outputs/structured_outputs", "unit_outputs/caller_use[use=container]",
         "unit_outputs/caller_use[use=namedtuple]"),
    )
    patches = (Patch.instead("fsdp_impl.unit:tree_flatten", _plain_tensors_only),)


def _final_with_zero_grads(final: Fn) -> Fn:
    def final_then_zero_missing_grads(state: Any) -> None:
        final(state)
        for unit in state.units:
            handle = unit.handle
            if handle is not None and handle.sharded_grad() is None:
                handle.accumulate_sharded_grad(torch.zeros_like(handle.flat_param))

    return final_then_zero_missing_grads


class ZeroGradForUnused(_Mutant):
    """Gives units that took no part in the loss a zero gradient instead of ``None``."""

    name = "mutant-zero-grad-for-unused"
    breaks = "grad None for parameters unused in forward"
    expect = Expect("module_no_compute_grad", "thread", ("training/module_no_compute_grad",))
    patches = (Patch("fsdp_impl.unit:_final_callback", _final_with_zero_grads),)


def _post_backward_once(post_backward: Fn) -> Fn:
    def post_backward_first_piece(unit: Any, full: Any) -> None:
        if getattr(unit, "_mutant_reduced", False):
            full.grad = None
            return
        if full.grad is not None:
            unit._mutant_reduced = True
        post_backward(unit, full)

    return post_backward_first_piece


def _final_clearing_first_piece(final: Fn) -> Fn:
    def final_then_clear(state: Any) -> None:
        final(state)
        for unit in state.units:
            unit._mutant_reduced = False

    return final_then_clear


class FirstGradPieceOnly(_Mutant):
    """Reduces only the first gradient a unit's flat parameter accumulates per backward."""

    name = "mutant-first-grad-piece-only"
    breaks = "reducing every gradient piece a unit receives in one backward"
    expect = _REENTRANT_CHECKPOINT
    patches = (
        Patch("fsdp_impl.unit:_post_backward_hook", _post_backward_once),
        Patch("fsdp_impl.unit:_final_callback", _final_clearing_first_piece),
    )


def _post_backward_in_outer_task(post_backward: Fn) -> Fn:
    def post_backward_as_if_outer(unit: Any, full: Any) -> None:
        unit.backward_task = torch._C._current_graph_task_id()
        post_backward(unit, full)

    return post_backward_as_if_outer


class NoNestedBackwardGuard(_Mutant):
    """Reshards a unit after the first gradient piece even when a nested (reentrant) backward delivered it."""

    name = "mutant-no-nested-backward-guard"
    breaks = "keeping parameters for the outer backward after a reentrant checkpoint's nested backward"
    expect = _REENTRANT_CHECKPOINT
    patches = (Patch("fsdp_impl.unit:_post_backward_hook", _post_backward_in_outer_task),)


def _accumulate_unless_offloaded(accumulate: Fn) -> Fn:
    def accumulate_on_device_only(handle: Any, grad: Any) -> None:
        if not handle.offload_params:
            accumulate(handle, grad)

    return accumulate_on_device_only


class OffloadedGradsDropped(_Mutant):
    """With parameter CPU offload, reduced gradients never reach the offloaded parameters."""

    name = "mutant-offloaded-grads-dropped"
    breaks = "gradients of CPU-offloaded parameters"
    expect = Expect("device_id_cpu_offload and not gpu", "thread", ("placement/device_id_cpu_offload[on=cpu]",))
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.accumulate_sharded_grad", _accumulate_unless_offloaded),)


def _accumulate_into_nothing(accumulate: Fn) -> Fn:
    def accumulate_replacing(handle: Any, grad: Any) -> None:
        drop_grads(handle)
        accumulate(handle, grad)

    return accumulate_replacing


class AccumulationOverwrites(_Mutant):
    """A later backward before the optimizer step replaces the gradient instead of adding to it."""

    name = "mutant-accumulation-overwrites"
    breaks = "gradient accumulation across backwards"
    #: The parity fuzzer draws 1-3 backwards per step; shrinking ends at two.
    expect = Expect("parity_ws", "process", ("fuzz/parity_ws1", "fuzz/parity_ws2", "fuzz/parity_ws4"))
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.accumulate_sharded_grad", _accumulate_into_nothing),)


def _forward_without_hooks(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from fsdp_impl import unit

    args, kwargs = unit.pre_forward_hook(module, args, kwargs)
    return unit.post_forward_hook(module, args, kwargs, unit._state(module).module.forward(*args, **kwargs))


class UserHooksSkipped(_Mutant):
    """A wrapper calls its wrapped module's ``forward`` directly, so the user's hooks on that module never run."""

    name = "mutant-user-hooks-skipped"
    breaks = "running the user's own hooks on a wrapped module"
    expect = Expect("module_hooks", "thread", ("user_hooks/module_hooks[api=wrap]",))
    patches = (Patch.instead("fsdp_impl.unit:run_forward", _forward_without_hooks),)


def _no_hooks(_params: list[torch.Tensor]) -> None:
    return None


class PostAccumulateGradHooksSkipped(_Mutant):
    """The parameters' post-accumulate-grad hooks never run once a reduced gradient is accumulated."""

    name = "mutant-post-accumulate-grad-hooks-skipped"
    breaks = "running the user's post-accumulate-grad hooks on the sharded parameters"
    expect = Expect("post_accumulate_grad_hooks", "thread", ("user_hooks/post_accumulate_grad_hooks",))
    patches = (Patch.instead("fsdp_impl.reduction:run_post_accumulate_grad_hooks", _no_hooks),)
