"""The per-unit runtime: unshard/reshard around forward and backward, hooks, prefetch.

[Note: unit lifecycle]
Both front doors run the same hooks (:func:`pre_forward_hook`,
:func:`post_forward_hook`); what a user may change between iterations is in
``UnitControls``. Forward: the root's first forward runs lazy init (shares one
:class:`RootState` across its units). Each unit's pre-forward checks/records the
execution order, waits for its all-gather (issuing it unless prefetched),
installs views of the unsharded flat parameter, then issues the all-gathers it
prefetches: the modules listed with ``set_modules_to_forward_prefetch``, else
with ``forward_prefetch`` the next unit recorded. Post-forward reshards as
``reshard_after_forward`` says (None, FULL_SHARD's rule: every unit but the
root; the wrapper also whenever no backward can follow); an int keeps this
rank's share of the gathered parameter for an all-gather over that many
consecutive ranks in backward. It then hooks every tensor output.

Backward: the first pre-backward hook queues the root's final callback; a
unit's pre-backward hook all-gathers again if the parameter was freed, then
prefetches (the listed modules, else the previous recorded unit for
BACKWARD_PRE); the post-accumulate-grad hook on the unsharded leaf issues the
gradient reduction asynchronously, frees the unsharded parameter (unless
``reshard_after_backward`` is off) and prefetches for BACKWARD_POST. One reduction
is in flight at a time: a unit's hook first finishes the previous unit's (its
input, a whole unsharded gradient, is held until then), so unsharded gradients
do not pile up over a backward. The final callback finishes the last one,
reshards units whose outputs were unused and ends the iteration (exec order,
per-iteration flags).

[Note: no_sync]
With ``UnitControls.requires_gradient_sync`` off (every unit inside the root's
``no_sync()``, :mod:`fsdp_impl.no_sync`; per unit with FSDP2's
``set_requires_gradient_sync``) the post-accumulate-grad hook reduces nothing:
it adds the unsharded gradient to ``UnitState.unsynced_grad`` and frees the
parameter as configured. The kept gradient stays on the compute device (with CPU
offload too: only a reduced gradient is offloaded) in the dtype backward
computed it in: ``param_dtype`` under mixed precision, as torch's FSDP1 keeps it
in the unsharded ``FlatParameter.grad``; ``fully_shard`` units keep it in
``reduce_dtype`` as FSDP2 does. The first synchronizing backward adds the kept
gradient to its own, then reduces the sum as usual, so the step sees the mean
over ranks of every micro-batch's gradient. Meanwhile the exposed (sharded)
gradients stay those of the last synchronized backward, and ``zero_grad`` does
not reach the kept one; torch's FSDP1 shows the unsharded gradient in ``.grad``
inside the context instead, and keeps a SHARD_GRAD_OP unit's unsharded parameter
there (a memory-for-speed heuristic).

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

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from fsdp_impl import precision, reduction
from fsdp_impl.api import BackwardPrefetch, ShardedState, TrainingState
from fsdp_impl.exec_order import ExecOrderData
from fsdp_impl.unit_state import RootState, UnitState, named_unit_states, unit_state

__all__ = [
    "MAX_PREFETCHED",
    "lazy_init",
    "run_forward",
    "pre_forward_hook",
    "post_forward_hook",
    "in_backward",
    "HOMOGENEOUS_ATTRS",
    "reset_iteration",
]

MAX_PREFETCHED = 2
#: Settings every unit under one root must agree on: the name torch reports -> the UnitConfig field.
HOMOGENEOUS_ATTRS = {
    "_use_orig_params": "use_orig_params",
    "limit_all_gathers": "limit_all_gathers",
    "_use_full_prec_in_eval": "use_full_prec_in_eval",
}


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _state(module: nn.Module) -> UnitState:
    state = unit_state(module)
    if state is None:
        raise TypeError(f"{type(module).__name__} is not an FSDP unit")
    return state


# -- lazy init ------------------------------------------------------------------------------
def lazy_init(root: nn.Module) -> None:
    """Make ``root`` the root of every unit below it and check their shared settings."""
    root_unit = _state(root)
    named = named_unit_states(root)
    units = [unit for _, unit in named]
    for reported, config_field in HOMOGENEOUS_ATTRS.items():
        values = {getattr(unit.config, config_field) for unit in units}
        if len(values) != 1:
            raise ValueError(f"Expects one homogeneous value for {reported} but got {values}")
    for unit in units:
        _check_ready_for_training(unit)
    state = RootState(units, ExecOrderData(units, root_unit.groups.process_group))
    state.buffer_dtypes = {name: buf.dtype for name, buf in root_unit.module.named_buffers()}
    for prefix, unit in named:
        unit.is_root = unit is root_unit
        unit.root = state
        unit.fqn_prefix = f"{prefix}." if prefix else ""


def _check_ready_for_training(unit: UnitState) -> None:
    """Lazy-init checks that need the final model (after the user may have moved it)."""
    handle = unit.handle
    if handle is None:
        return
    if not unit.config.use_orig_params and hasattr(handle.flat_param, "_in_backward_optimizers"):
        raise RuntimeError("FSDP optimizer in backward only supported with use_orig_params=True!")
    device = handle.flat_param.device
    if handle.offload_params and device.type != "cpu":
        raise RuntimeError(
            "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
            f"{device}. Make sure to not move the module from CPU when offloading parameters."
        )
    if not handle.offload_params and device != unit.compute_device:
        raise RuntimeError(
            f"An FSDP-managed module unexpectedly has parameters on {device}. "
            f"Make sure to move "
            f"the module to {unit.compute_device} before training."
        )


# -- forward ---------------------------------------------------------------------------------
def run_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapper's forward: its wrapped module between the unit's pre- and post-forward."""
    args, kwargs = pre_forward_hook(module, args, kwargs)
    return post_forward_hook(module, args, kwargs, _state(module).module(*args, **kwargs))


def pre_forward_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Before the unit ``module`` computes (``fully_shard`` registers it as a forward pre-hook):
    lazy init, the root's input placement and precision, input casts, the all-gather."""
    unit = _state(module)
    if unit.root is None:
        lazy_init(module)
    state = unit.root
    assert state is not None
    if unit.is_root:
        args, kwargs = precision.to_device((args, kwargs), unit.compute_device)
        precision.set_root_precision(unit, state)
    args, kwargs = precision.cast_inputs(unit, (args, kwargs))
    _pre_forward(unit, state, in_backward())
    return args, kwargs


def post_forward_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """After the unit ``module`` computed (``fully_shard``'s forward hook): reshard, hook the outputs."""
    unit = _state(module)
    assert unit.root is not None
    _post_forward(unit, unit.root, output, in_backward())
    return precision.cast_floating(output, unit.config.output_dtype)


def _pre_forward(unit: UnitState, state: RootState, recompute: bool) -> None:
    unit.training_state = TrainingState.FORWARD
    handle = unit.handle
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
    handle.register_post_accumulate_hook(_bound_weakly(_post_backward_hook, unit))
    if not recompute:
        recorded = state.exec_order.next_forward(unit) if unit.config.forward_prefetch else None
        _prefetch_next(unit, state, unit.controls.forward_prefetch, recorded)


def _bound_weakly(hook: Callable[..., None], unit: UnitState) -> Callable[..., None]:
    """``hook`` with ``unit`` first, holding it weakly: a tensor's hook keeps what it holds alive past the
    cycle collector (the unsharded flat parameter is referenced from C++ by the views over it), so a
    strong reference from the flat parameter to its unit kept the whole model, and its process groups
    with their threads, alive after the user dropped it."""
    ref = weakref.ref(unit)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            hook(target, *args)
    return call


def _post_forward(unit: UnitState, state: RootState, output: Any, recompute: bool) -> None:
    grad_follows = torch.is_grad_enabled()
    if unit.handle is not None and not recompute:
        _reshard_after_forward(unit, grad_follows)
    if grad_follows:
        hook = _bound_weakly(_pre_backward_hook, unit)
        for tensor in _output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(hook)
    unit.training_state = TrainingState.IDLE


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor of a unit's output: in pytree containers (tuples, lists, dicts, namedtuples) and in
    dataclass fields (pytree leaves unless registered), nested either way."""
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


def _reshard_after_forward(unit: UnitState, grad_follows: bool) -> None:
    """Free the unsharded parameter as ``UnitControls.reshard_after_forward`` says (None: unless
    root), or keep a piece of it for a smaller all-gather in backward (an int)."""
    handle, setting = unit.handle, unit.controls.reshard_after_forward
    assert handle is not None
    unless_root = setting is None and not unit.is_root
    if setting is True or unless_root or (not grad_follows and unit.config.reshard_without_grad):
        handle.reshard()
    elif setting is not None and setting is not False:
        assert unit.groups.post_forward_group is not None
        handle.reshard_to(unit.groups.post_forward_group)


def _unshard_now(unit: UnitState, state: RootState) -> None:
    """Wait for ``unit``'s unsharded parameter (this is where its data is needed)."""
    assert unit.handle is not None
    if unit in state.prefetched:
        state.prefetched.remove(unit)
    unit.handle.wait_unshard()


def _prefetch(state: RootState, target: UnitState | None, limit: bool) -> None:
    """Issue ``target``'s all-gather without waiting, within the in-flight bound."""
    if target is None or target.handle is None or target.handle.state is not ShardedState.SHARDED:
        return
    if in_backward() and not target.controls.unshard_in_backward:
        return
    if limit and len(state.prefetched) >= MAX_PREFETCHED:
        return
    target.handle.start_unshard()
    state.prefetched.append(target)


def _prefetch_next(
    unit: UnitState, state: RootState, explicit: list[UnitState] | None, recorded: UnitState | None
) -> None:
    """Issue the all-gathers the user listed for ``unit`` (FSDP2's ``set_modules_to_*_prefetch``),
    in their order, else the one of the recorded order's neighbour (None: none)."""
    for target in explicit if explicit is not None else [recorded]:
        _prefetch(state, target, unit.config.limit_all_gathers)


# -- backward --------------------------------------------------------------------------------
def _pre_backward_hook(unit: UnitState, grad: torch.Tensor) -> None:
    state = unit.root
    assert state is not None
    if not state.callback_queued:
        state.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_final_callback, state)
        )
    if unit.ran_pre_backward:
        return
    unit.ran_pre_backward = True
    unit.backward_task = torch._C._current_graph_task_id()
    unit.training_state = TrainingState.BACKWARD_PRE
    handle = unit.handle
    if handle is None or not unit.controls.unshard_in_backward:
        return
    handle.drop_unviewed_grad()
    was_sharded = handle.state is not ShardedState.UNSHARDED
    _unshard_now(unit, state)
    if was_sharded or handle.use_orig_params:
        # Views for activation-checkpoint recomputation, which runs in backward.
        with torch.enable_grad():
            handle.install_unsharded_views()
    pre = unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
    _prefetch_next(unit, state, unit.controls.backward_prefetch, state.exec_order.next_backward(unit) if pre else None)


def _post_backward_hook(unit: UnitState, full: torch.Tensor) -> None:
    handle = unit.handle
    state = unit.root
    assert handle is not None and state is not None
    grad = full.grad
    full.grad = None
    if grad is None:
        return
    if grad.requires_grad:
        raise RuntimeError("gradients of gradients (create_graph=True) are not supported")
    unit.training_state = TrainingState.BACKWARD_POST
    grad = _with_unsynced_grad(unit, grad)
    if unit.controls.requires_gradient_sync:
        reduction.finish_reductions(state)  # [Note: unit lifecycle]: one reduction in flight
        state.reductions.append(reduction.issue_reduction(unit, grad))
    else:  # [Note: no_sync]
        policy = unit.config.low_precision(unit.training)
        keep_in = policy.reduce_dtype if policy is not None and unit.config.unsynced_in_reduce_dtype else None
        unit.unsynced_grad = grad if keep_in is None else grad.to(keep_in)
    if torch._C._current_graph_task_id() != unit.backward_task and unit.ran_pre_backward:
        # A reentrant checkpoint inside this unit runs its own (nested) backward: more of
        # this unit's gradient may arrive in the outer backward, which still needs the
        # parameters. Reductions of the pieces add up; the final callback reshards.
        return
    if unit.controls.reshard_after_backward:
        handle.reshard()
    if unit.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        _prefetch(state, state.exec_order.next_backward(unit), unit.config.limit_all_gathers)


def _with_unsynced_grad(unit: UnitState, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` plus the gradient backwards inside ``no_sync`` kept for ``unit``, which is taken."""
    kept, unit.unsynced_grad = unit.unsynced_grad, None
    return grad if kept is None else kept.add_(grad)


def _final_callback(state: RootState) -> None:
    """End of backward: finish reductions (unless the root's ``is_last_backward`` is off: the next backward
    finishes them, as FSDP2 waits for pending reductions on the last backward only), reshard everything,
    start the next iteration."""
    if all(unit.controls.is_last_backward for unit in state.units if unit.is_root):
        reduction.finish_reductions(state)
    for unit in state.units:
        handle = unit.handle
        if handle is None or not unit.controls.reshard_after_backward:
            pass
        elif not handle.is_resharded:
            handle.reshard()
        elif handle.use_orig_params:
            handle.install_sharded_params()
    _iteration_over(state)
    state.exec_order.next_iter()


def reset_iteration(root: UnitState) -> None:
    """After an exception ended a forward or backward early (FSDP2's ``reset_iter_state``, on the root only):
    wait for the collectives in flight and drop the reductions, the gradients kept without sync and the
    partial reductions, reshard every unit and start a fresh iteration, as if the failed one never ran."""
    if root.is_root is False:
        raise RuntimeError("reset_iter_state must be called on the root FSDP module")
    state = root.root
    if state is None:  # no forward ran yet: nothing to reset
        return
    reduction.discard_reductions(state)
    for unit in state.units:
        if unit.handle is not None:
            unit.handle.full.grad = None
            unit.handle.reshard()
        unit.unsynced_grad = unit.partial_reduce = None
    _iteration_over(state)
    state.exec_order.abort_iter()


def _iteration_over(state: RootState) -> None:
    """What every unit and the root forget when an iteration ends, finished or aborted."""
    for unit in state.units:
        unit.ran_pre_backward = False
        unit.backward_task = -1
        unit.training_state = TrainingState.IDLE
    state.prefetched.clear()
    state.callback_queued = False
