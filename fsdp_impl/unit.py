"""The per-unit runtime: unshard/reshard around forward and backward, hooks, prefetch.

[Note: unit lifecycle]
Forward: the root's first forward runs lazy init (shares one :class:`RootState`
across its units). Each unit's pre-forward checks/records the execution order,
waits for its all-gather (issuing it unless prefetched), installs views of the
unsharded flat parameter, and with ``forward_prefetch`` issues the next unit's
all-gather before computing. Post-forward frees the unsharded parameter for
FULL_SHARD / HYBRID_SHARD non-root units (or whenever no backward can follow)
and registers a pre-backward hook on every tensor output.

Backward: the first pre-backward hook queues the root's final callback; a
unit's pre-backward hook all-gathers again if the parameter was freed (then
prefetches the next unit for BACKWARD_PRE); the post-accumulate-grad hook on the
unsharded leaf issues the gradient reduction asynchronously, frees the unsharded
parameter and prefetches for BACKWARD_POST. Reductions are awaited at the latest
in the final callback, which also reshards units whose outputs were unused and
ends the iteration (exec order, per-iteration flags).

Forward calls made *during* backward (activation-checkpoint recomputation) skip
order recording, prefetch and post-forward resharding: the recomputed
activations are consumed by the backward that is already running.

[Note: limit_all_gathers]
With ``limit_all_gathers=True`` at most :data:`MAX_PREFETCHED` units (2) may have
an all-gather issued by prefetch but not yet consumed by their own compute; a
prefetch beyond that is skipped (the unit then gathers on demand). Prefetch looks
one unit ahead, so the bound holds with room for forward and backward prefetch
overlapping at the forward/backward boundary. With ``False`` nothing is bounded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_impl import collectives
from fsdp_impl.api import RESHARD_AFTER_FORWARD, BackwardPrefetch, ShardedState, TrainingState
from fsdp_impl.exec_order import ExecOrderData

if TYPE_CHECKING:
    from fsdp_impl.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

__all__ = ["RootState", "MAX_PREFETCHED", "lazy_init", "run_forward", "HOMOGENEOUS_ATTRS"]

MAX_PREFETCHED = 2
HOMOGENEOUS_ATTRS = ("_use_orig_params", "limit_all_gathers", "_use_full_prec_in_eval")


@dataclass
class _Reduction:
    """One unit's gradient on its way from ``full.grad`` to the sharded gradient."""

    unit: FSDP
    pending: collectives.Pending | None
    stage: str  # "reduce_scatter" -> "all_reduce" -> "done"


@dataclass
class RootState:
    """State shared by all units under one root, reset at the end of each backward."""

    units: list[FSDP]
    exec_order: ExecOrderData
    reductions: list[_Reduction] = field(default_factory=list)
    prefetched: list[FSDP] = field(default_factory=list)
    callback_queued: bool = False


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# -- lazy init ------------------------------------------------------------------------------
def lazy_init(root: FSDP) -> None:
    """Make ``root`` the root of every unit below it and check their shared settings."""
    from fsdp_impl.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    units = [module for module in root.modules() if isinstance(module, FSDP)]
    names = {id(module): name for name, module in root.named_modules() if isinstance(module, FSDP)}
    for attr in HOMOGENEOUS_ATTRS:
        values = {getattr(unit, attr) for unit in units}
        if len(values) != 1:
            raise ValueError(f"Expects one homogeneous value for {attr} but got {values}")
    for unit in units:
        unit._check_ready_for_training()
    exec_order = ExecOrderData(units, root.process_group)
    state = RootState(units, exec_order)
    for unit in units:
        unit._is_root = unit is root
        unit._root_state = state
        prefix = names[id(unit)]
        unit._fqn_prefix = f"{prefix}." if prefix else ""


# -- forward ---------------------------------------------------------------------------------
def run_forward(unit: FSDP, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``unit``'s forward wrapped in its pre- and post-forward logic."""
    if unit._root_state is None:
        lazy_init(unit)
    state = unit._root_state
    assert state is not None
    if unit._is_root:
        args, kwargs = _to_device((args, kwargs), unit.compute_device)
    recompute = _in_backward()
    _pre_forward(unit, state, recompute)
    output = unit._fsdp_wrapped_module(*args, **kwargs)
    _post_forward(unit, state, output, recompute)
    return output


def _to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x, tree
    )


def _pre_forward(unit: FSDP, state: RootState, recompute: bool) -> None:
    unit.training_state = TrainingState.FORWARD
    handle = unit._handle
    if handle is None:
        return
    if not recompute:
        state.exec_order.record_pre_forward(unit, unit.training)
    _unshard_now(unit, state)
    if recompute:
        with torch.enable_grad():
            handle.install_unsharded_views()
    else:
        handle.install_unsharded_views()
    handle.register_post_accumulate_hook(functools.partial(_post_backward_hook, unit))
    if unit.forward_prefetch and not recompute:
        _prefetch(state, state.exec_order.next_forward(unit), unit.limit_all_gathers)


def _post_forward(unit: FSDP, state: RootState, output: Any, recompute: bool) -> None:
    handle = unit._handle
    grad_follows = torch.is_grad_enabled()
    if handle is not None and not recompute:
        reshard_now = not grad_follows or (
            not unit._is_root and unit.sharding_strategy in RESHARD_AFTER_FORWARD
        )
        if reshard_now:
            handle.reshard()
    if grad_follows:
        hook = functools.partial(_pre_backward_hook, unit)
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(hook)
    unit.training_state = TrainingState.IDLE


def _unshard_now(unit: FSDP, state: RootState) -> None:
    """Wait for ``unit``'s unsharded parameter (this is where its data is needed)."""
    assert unit._handle is not None
    if unit in state.prefetched:
        state.prefetched.remove(unit)
    unit._handle.wait_unshard()


def _prefetch(state: RootState, target: FSDP | None, limit: bool) -> None:
    """Issue ``target``'s all-gather without waiting, within the in-flight bound."""
    if target is None or target._handle is None or target._handle.state is not ShardedState.SHARDED:
        return
    if limit and len(state.prefetched) >= MAX_PREFETCHED:
        return
    target._handle.start_unshard()
    state.prefetched.append(target)


# -- backward --------------------------------------------------------------------------------
def _pre_backward_hook(unit: FSDP, grad: torch.Tensor) -> None:
    state = unit._root_state
    assert state is not None
    if not state.callback_queued:
        state.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_final_callback, state)
        )
    if unit._ran_pre_backward:
        return
    unit._ran_pre_backward = True
    unit._backward_task = torch._C._current_graph_task_id()
    unit.training_state = TrainingState.BACKWARD_PRE
    handle = unit._handle
    if handle is None:
        return
    was_sharded = handle.state is not ShardedState.UNSHARDED
    _unshard_now(unit, state)
    if was_sharded or handle.use_orig_params:
        # Views for activation-checkpoint recomputation, which runs in backward.
        with torch.enable_grad():
            handle.install_unsharded_views()
    if unit.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch(state, state.exec_order.next_backward(unit), unit.limit_all_gathers)


def _post_backward_hook(unit: FSDP, full: torch.Tensor) -> None:
    handle = unit._handle
    state = unit._root_state
    assert handle is not None and state is not None
    grad = full.grad
    full.grad = None
    if grad is None:
        return
    if grad.requires_grad:
        raise RuntimeError("gradients of gradients (create_graph=True) are not supported")
    unit.training_state = TrainingState.BACKWARD_POST
    _advance_reductions(state)
    state.reductions.append(_issue_reduction(unit, grad))
    if torch._C._current_graph_task_id() != unit._backward_task and unit._ran_pre_backward:
        # A reentrant checkpoint inside this unit runs its own (nested) backward: more of
        # this unit's gradient may arrive in the outer backward, which still needs the
        # parameters. Reductions of the pieces add up; the final callback reshards.
        return
    handle.reshard()
    if unit.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        _prefetch(state, state.exec_order.next_backward(unit), unit.limit_all_gathers)


def _issue_reduction(unit: FSDP, grad: torch.Tensor) -> _Reduction:
    handle = unit._handle
    assert handle is not None
    if handle.shard_size > 1:
        out = torch.empty(handle.shard_numel, dtype=grad.dtype, device=grad.device)
        return _Reduction(
            unit, collectives.reduce_scatter(out, grad, handle.shard_group), "reduce_scatter"
        )
    return _start_all_reduce(unit, grad)


def _start_all_reduce(unit: FSDP, grad: torch.Tensor) -> _Reduction:
    group = unit._replicate_group
    if group is None or collectives.group_size(group) == 1:
        return _Reduction(unit, collectives.Pending(None, grad), "done")
    return _Reduction(unit, collectives.all_reduce(grad, group), "all_reduce")


def _advance_reductions(state: RootState) -> None:
    """Move finished reduce-scatters of earlier units on to their replicate all-reduce."""
    for index, reduction in enumerate(state.reductions):
        if reduction.stage == "reduce_scatter" and reduction.unit._replicate_group is not None:
            assert reduction.pending is not None
            state.reductions[index] = _start_all_reduce(reduction.unit, reduction.pending.wait())


def _finish_reductions(state: RootState) -> None:
    """Wait for every reduction and add the averaged gradients to the exposed grads."""
    _advance_reductions(state)
    for reduction in state.reductions:
        assert reduction.pending is not None
        grad = reduction.pending.wait()
        grad.div_(reduction.unit._dp_world_size)
        assert reduction.unit._handle is not None
        reduction.unit._handle.accumulate_sharded_grad(grad)
    state.reductions.clear()


def _final_callback(state: RootState) -> None:
    """End of backward: finish reductions, reshard everything, start the next iteration."""
    _finish_reductions(state)
    for unit in state.units:
        if unit._handle is not None and unit._handle.state is not ShardedState.SHARDED:
            unit._handle.reshard()
        elif unit._handle is not None and unit._handle.use_orig_params:
            unit._handle.install_sharded_params()
        unit._ran_pre_backward = False
        unit._backward_task = -1
        unit.training_state = TrainingState.IDLE
    state.prefetched.clear()
    state.exec_order.next_iter()
    state.callback_queued = False


def replicate_world(group: dist.ProcessGroup | None) -> int:
    """Size of the replicate group (1 when a unit has none)."""
    return 1 if group is None else collectives.group_size(group)
