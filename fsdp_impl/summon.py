"""``summon_full_params``: a wrapped module's original parameters, full, registered under their own names.

A unit's original parameters are registered over full views (summoned, and for a FULL state dict) or
over this rank's local pieces (a SHARDED state dict, :mod:`fsdp_impl.state_dict`), and the flat
parameter comes back when the block ends; ``with_grads`` exposes the full gradients the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import collectives
from fsdp_impl.api import ShardedState, TrainingState
from fsdp_impl.flat_param import FLAT_PARAM_NAME, FlatParamHandle, _set_param, set_grad
from fsdp_impl.unit_state import UnitState, unit_state, unit_states

__all__ = ["check_idle", "gather_shard_sized", "managing_units", "register_orig", "summon_full_params",
           "unregister_orig"]


def managing_units(module: nn.Module) -> list[UnitState]:
    """Every unit in ``module``'s tree that has a flat parameter (the wrapper's: see below)."""
    units = [unit for unit in unit_states(module) if unit.handle is not None]
    if any(unit.handle is not None and unit.handle.sharding is not None for unit in units):
        raise TypeError(
            "summon_full_params and the wrapper's state dicts take FullyShardedDataParallel units; "
            "fully_shard modules hold DTensors: use model.state_dict(), torch.distributed.checkpoint, full_tensor()"
        )
    return units


def check_idle(units: list[UnitState]) -> None:
    busy = [u.training_state for u in units if u.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(f"summon_full_params / state dicts need idle units, got states {busy}")


def register_orig(unit: UnitState, full: bool, source: torch.Tensor | None = None) -> None:
    """Register original params over full views (``full``: of the gathered parameters, or of ``source``, a copy
    of them) or local pieces."""
    handle = unit.handle
    assert handle is not None
    if not handle.use_orig_params:
        unit.module._parameters.pop(FLAT_PARAM_NAME, None)
    shard = handle.flat_param.data
    for slot, view in zip(
        handle.slots, handle.unsharded_views(source) if full else [None] * len(handle.slots), strict=True
    ):
        slot.param.data = view.detach() if view is not None else handle.sharded_view(slot, shard)
        for module, name in slot.registrations:
            _set_param(module, name, slot.param, unsafe=False)


def unregister_orig(unit: UnitState) -> None:
    handle = unit.handle
    assert handle is not None
    if handle.use_orig_params:
        handle.install_sharded_params()
        return
    for slot in handle.slots:
        for module, name in slot.registrations:
            module._parameters.pop(name, None)
    unit.module.register_parameter(FLAT_PARAM_NAME, handle.flat_param)
    if handle.state is ShardedState.UNSHARDED:  # between forward and backward: a recomputation reads them
        with torch.set_grad_enabled(handle.full.requires_grad):
            handle.install_unsharded_views()


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module, writeback: bool = True, with_grads: bool = False, *, recurse: bool = True,
    rank0_only: bool = False, offload_to_cpu: bool = False,
) -> Generator[None, None, None]:
    """Full original parameters (registered under their own names) inside the context.

    ``writeback`` copies in-place edits back into the local shards on exit;
    ``with_grads`` also exposes the full (averaged) gradients as ``.grad``;
    ``recurse=False`` summons ``module``'s own unit alone (nothing where it is not a unit);
    ``rank0_only``: only global rank 0 sees them; every rank gathers (a collective), the others drop
    what they gathered at once and keep their shards registered;
    ``offload_to_cpu``: a sharded unit's full parameters are a copy on the CPU, which the writeback reads.
    """
    if writeback and rank0_only:
        raise NotImplementedError("summon_full_params(writeback=True, rank0_only=True): ranks other than 0 "
                                  "hold no full parameters to write back")
    if with_grads and offload_to_cpu:
        raise NotImplementedError("summon_full_params(with_grads=True, offload_to_cpu=True) is not supported")
    units = managing_units(module) if recurse else [u for u in [unit_state(module)] if u and u.handle]
    check_idle(units)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    # The dtype each unit computes in, back on exit: between forward and backward, backward
    # re-gathers into the low-precision leaf its saved views point at.
    precisions = [unit.handle.full.dtype == unit.handle.flat_param.dtype for unit in units]  # type: ignore[union-attr]
    for unit in units:
        unit.handle.set_full_precision(True)  # type: ignore[union-attr]
        unit.handle.start_unshard()  # type: ignore[union-attr]
    saved_grads = [_summon(unit, keep=keep, offload=offload_to_cpu, with_grads=with_grads) for unit in units]
    try:
        yield
    finally:
        for unit, grads, full_precision in zip(units, saved_grads, precisions, strict=True):
            handle = unit.handle
            assert handle is not None
            if writeback and unit.summoned is not None:  # summoned on every rank: rank0_only refuses a writeback
                start = handle.shard_rank * handle.shard_numel
                with torch.no_grad():
                    handle.flat_param.data.copy_(unit.summoned[start : start + handle.shard_numel])
            unit.summoned = None
            for slot in handle.slots:
                slot.param.grad = None
            unregister_orig(unit)
            handle.reshard()
            handle.set_full_precision(full_precision)
            for slot, grad in zip(handle.slots, grads, strict=True):
                _restore_grad(slot.param, grad)
            _restore_grad(handle.flat_param, unit.saved_flat_grad)
            unit.saved_flat_grad = None  # not held past the block (a stale shard-sized gradient)
            unit.training_state = TrainingState.IDLE


def _summon(unit: UnitState, *, keep: bool, offload: bool, with_grads: bool) -> list[torch.Tensor | None]:
    """Wait for ``unit``'s gather and register its full parameters (and gradients) where ``keep``; elsewhere
    free what was gathered, gradients gathered too (collective), and leave the shards registered. Returns the
    gradients set aside."""
    handle = unit.handle
    assert handle is not None
    handle.wait_unshard()
    saved = [slot.param.grad for slot in handle.slots]
    unit.saved_flat_grad = handle.flat_param.grad
    full_grads = _gather_full_grads(handle) if with_grads else None
    unit.training_state = TrainingState.SUMMON_FULL_PARAMS
    if not keep:
        handle.reshard()
        return saved
    # Only a sharded unit is offloaded (unsharded, its full parameters are the ones it keeps).
    unit.summoned = handle.full.detach().cpu() if offload and handle.shard_size > 1 else handle.full.detach()
    register_orig(unit, full=True, source=unit.summoned)
    if full_grads is not None:
        for slot, grad in zip(handle.slots, full_grads, strict=True):
            _restore_grad(slot.param, grad)
    return saved


def _restore_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Give ``param`` the gradient ``grad`` (set aside, or summoned; it may be in a low-precision dtype, see
    ``set_grad``), or none."""
    if grad is None:
        param.grad = None
    else:
        set_grad(param, grad)


def gather_shard_sized(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a shard-sized tensor of ``handle`` into the padded full layout."""
    shard = shard.to(handle.compute_device)
    if handle.shard_size == 1:
        return shard.clone()
    out = torch.empty(handle.padded_numel, dtype=shard.dtype, device=shard.device)
    return collectives.all_gather(out, shard.contiguous(), handle.shard_group).wait()


def _gather_full_grads(handle: FlatParamHandle) -> list[torch.Tensor | None]:
    """Each slot's full gradient (collective); ``None`` for all where no rank has one. Ranks agree whether there
    is one, since a rank whose shard holds no parameter's elements (padding only) has none of its own but takes
    part."""
    local = handle.sharded_grad()
    flag = torch.tensor([0 if local is None else 1], device=handle.compute_device)
    if handle.shard_size > 1:
        collectives.all_reduce(flag, handle.shard_group).wait()
    has_grad = bool(flag.item())
    stale = handle.flat_param.grad  # the dtype gradients were kept in, also on a padding-only rank
    dtype = stale.dtype if stale is not None else handle.flat_param.dtype
    shard = local if local is not None else torch.zeros_like(handle.flat_param.data, dtype=dtype)
    full = gather_shard_sized(handle, shard)
    return [full[slot.offset : slot.offset + slot.numel].view(slot.shape) if has_grad else None
            for slot in handle.slots]
