"""A unit's gradient reduction: reduce-scatter over the shard group, all-reduce over replicas, division.

[Note: partial reduction]
A hybrid unit (a 2-D mesh) reduces in two steps: reduce-scatter over its shard
group, then all-reduce of the piece over its replicate group. With
``UnitControls.requires_all_reduce`` off (FSDP2's ``set_requires_all_reduce``)
the second step is skipped: the reduce-scattered sum is added to
``UnitState.partial_reduce`` and no gradient is exposed. The next backward that
all-reduces adds the kept sum to its own piece first, so the optimizer sees the
mean over ranks of every micro-batch's gradient, and the replicas talk once.
``UnitControls.all_reduce_hook`` (FSDP2's ``set_all_reduce_hook``) runs on the
piece once every reduction of the backward is done (the all-reduce output, or
the reduce-scatter output without replicas), before the division by the world
size ([Note: gradient averaging] in ``collectives.py``): a hook scaling it in
place scales the gradient the optimizer sees.

[Note: comm hook]
FSDP1's ``register_comm_hook(state, hook)`` replaces the reduction of every
unit under the root (``UnitControls.comm_hook``): ``hook(state, grad)``
reduces a ``NO_SHARD`` unit's full flat gradient in place, ``hook(state,
padded, output)`` fills this rank's piece ``output`` from the full flat
gradient padded and laid out as reduce-scatter splits it. What the hook
leaves is the gradient, divided by nothing more, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_impl import collectives
from fsdp_impl.unit_state import Reduction, RootState, UnitState

__all__ = ["issue_reduction", "start_all_reduce", "finish_reductions", "discard_reductions",
           "run_post_accumulate_grad_hooks"]


def issue_reduction(unit: UnitState, grad: torch.Tensor) -> Reduction:
    """Start reducing ``unit``'s unsharded gradient ``grad`` (in the reduce dtype under mixed precision)."""
    handle = unit.handle
    assert handle is not None
    policy = unit.config.low_precision(unit.training)
    if policy is not None:
        grad = grad.to(policy.reduce_dtype or policy.param_dtype or grad.dtype)
    if unit.controls.comm_hook is not None:
        return _hooked_reduction(unit, grad, *unit.controls.comm_hook)
    if handle.shard_size > 1:
        out = torch.empty(handle.shard_numel, dtype=grad.dtype, device=grad.device)
        full = handle.layout.to_rank_major(grad)  # the order reduce-scatter splits in ([Note: shard layouts])
        return Reduction(unit, collectives.reduce_scatter(out, full, handle.shard_group), "reduce_scatter")
    return start_all_reduce(unit, grad)


def _hooked_reduction(unit: UnitState, grad: torch.Tensor, state: object, hook: Callable[..., None]) -> Reduction:
    """Reduce ``grad`` by the unit's communication hook, now ([Note: comm hook])."""
    handle = unit.handle
    assert handle is not None
    if handle.shard_size == 1:
        hook(state, grad)
        return Reduction(unit, collectives.Pending(None, grad), "hooked")
    out = torch.empty(handle.shard_numel, dtype=grad.dtype, device=grad.device)
    hook(state, handle.layout.to_rank_major(grad), out)
    return Reduction(unit, collectives.Pending(None, out), "hooked")


def start_all_reduce(unit: UnitState, grad: torch.Tensor) -> Reduction:
    """All-reduce ``grad`` over the replicas, or keep it for a later one ([Note: partial reduction])."""
    group = unit.groups.replicate_group
    if group is None or collectives.group_size(group) == 1:
        return Reduction(unit, collectives.Pending(None, grad), "done")
    if not unit.controls.requires_all_reduce:
        unit.partial_reduce = grad if unit.partial_reduce is None else unit.partial_reduce.add_(grad)
        return Reduction(unit, None, "kept")
    if unit.partial_reduce is not None:
        grad, unit.partial_reduce = grad.add_(unit.partial_reduce), None
    return Reduction(unit, collectives.all_reduce(grad, group), "all_reduce")


def _advance_reductions(state: RootState) -> None:
    """Move finished reduce-scatters of earlier units on to their replicate all-reduce."""
    for index, reduction in enumerate(state.reductions):
        if reduction.stage == "reduce_scatter" and reduction.unit.groups.replicate_group is not None:
            assert reduction.pending is not None
            state.reductions[index] = start_all_reduce(reduction.unit, reduction.pending.wait())


def run_post_accumulate_grad_hooks(params: list[torch.Tensor]) -> None:
    """Each parameter's post-accumulate-grad hooks, as autograd runs them after accumulating into a leaf: the
    exposed parameters are not the tensors autograd accumulates into (FSDP2 runs them likewise, pytorch#129450)."""
    for param in params:
        for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(param)


def finish_reductions(state: RootState) -> None:
    """Wait for every reduction, run the units' hooks and add the averaged gradients to the exposed grads."""
    _advance_reductions(state)
    for reduction in state.reductions:
        if reduction.stage == "kept":
            continue
        assert reduction.pending is not None and reduction.unit.handle is not None
        grad = reduction.pending.wait()
        if reduction.stage != "hooked":  # a communication hook's result is the gradient as it left it
            if reduction.unit.controls.all_reduce_hook is not None:
                reduction.unit.controls.all_reduce_hook(grad)
            grad.div_(reduction.unit.controls.gradient_divide_factor or reduction.unit.groups.dp_world_size)
        reduction.unit.handle.accumulate_sharded_grad(grad)
        if reduction.unit.handle.use_orig_params:
            run_post_accumulate_grad_hooks([slot.param for slot in reduction.unit.handle.slots])
    state.reductions.clear()


def discard_reductions(state: RootState) -> None:
    """Wait for the collectives in flight (every rank issued them) and drop their results."""
    for reduction in state.reductions:
        if reduction.pending is not None:
            reduction.pending.wait()
    state.reductions.clear()
