"""``FSDPModule``: FSDP2's per-module controls on a ``fully_shard``-ed module (``composable.py`` mixes it into
the module's class), ``UnshardHandle`` and ``register_fsdp_forward_method``; each sets a unit's
``UnitControls`` or runs the unit's hooks ([Note: unit lifecycle] in ``unit.py``)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fsdp_impl import unit
from fsdp_impl.api import ShardedState
from fsdp_impl.unit_state import UnitState, unit_state

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: :meth:`wait` makes the gathered parameters usable."""

    def __init__(self, state: UnitState) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for the all-gather and register the unsharded parameters (no-op once consumed)."""
        handle = self._state.handle
        if handle is not None and handle.state is ShardedState.UNSHARDING:
            handle.wait_unshard()
            handle.install_unsharded_views()


class FSDPModule:
    """Mixed into a ``fully_shard``-ed module's class: FSDP2's per-module controls."""

    def _own(self) -> UnitState:
        state = unit_state(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"No FSDP state found on {type(self).__name__}")
        return state

    def _units(self, recurse: bool) -> list[UnitState]:
        if not recurse:
            return [self._own()]
        return [state for m in self.modules() if (state := unit_state(m)) is not None]  # type: ignore[attr-defined]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not its submodules'); with ``async_op`` return a
        handle to wait on (the module's next forward waits otherwise)."""
        state = self._own()
        if state.handle is not None:
            state.handle.start_unshard()
        pending = UnshardHandle(state)
        if async_op:
            return pending
        pending.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones (not recursive)."""
        handle = self._own().handle
        if handle is not None:
            handle.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduces gradients ([Note: no_sync] in ``unit.py``)."""
        for state in self._units(recurse):
            state.controls.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free (``True``) or keep (``False``) the unsharded parameters after forward, root included."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for state in self._units(recurse):
            state.controls.reshard_after_forward = reshard_after_forward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` instead of the data-parallel world size (not
        recursive, as torch's; [Note: gradient averaging] in ``collectives.py``)."""
        self._own().controls.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (as in torch): :meth:`set_gradient_divide_factor`."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Whether backward all-reduces a hybrid module's gradients over the replicas (``False``: the
        reduce-scattered sums add up until one does; [Note: partial reduction] in ``reduction.py``)."""
        for state in self._units(recurse):
            state.controls.requires_all_reduce = requires_all_reduce

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Run ``hook`` on this module's reduced gradient piece before the division by the world size (the
        all-reduce output on a 2-D mesh, else the reduce-scatter output); ``stream`` is not modelled."""
        self._own().controls.all_reduce_hook = hook

    def reset_iter_state(self) -> None:
        """Recover from an exception raised mid forward or backward: the next iteration runs as a fresh one
        (the failed one's gradients are dropped). Only on the root."""
        unit.reset_iteration(self._own())

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of its micro-batches (call it on the root): only the last one
        waits for the gradient reductions still in flight; the next backward finishes them otherwise."""
        self._own().controls.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward all-gathers this module's parameters (``False`` only for a module whose backward
        reads none of them, an embedding: its gradients are computed all the same)."""
        self._own().controls.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for FSDP2's API; nothing to set: a unit reduces its whole flat gradient, where a parameter this
        rank's backward did not reach is zeros, so ranks using different parameters always issue matching
        reductions (torch's ``True``)."""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the unsharded parameters (``False``: the next forward reuses them)."""
        for state in self._units(recurse):
            state.controls.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules``' parameters, in this order, right after this module's in forward."""
        self._own().controls.forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules``' parameters, in this order, right after this module's in backward."""
        self._own().controls.backward_prefetch = _states_of(modules)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module._apply`` (``to_empty``, ``.to``) on the sharded parameters, then the unit's
        shard follows their new local tensors ([Note: two front doors])."""
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        handle = self._own().handle
        if handle is not None:
            handle.follow_moved_params()
        return result


def _states_of(modules: list[FSDPModule]) -> list[UnitState]:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
    return [module._own() for module in modules]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.method_name`` between the unit's pre- and post-forward, as ``forward`` runs: its parameters
    are gathered for it (and freed after it as ``reshard_after_forward`` says). A no-op for a module that is
    not a ``fully_shard``-ed one, so the same code runs sharded or not."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = unit.pre_forward_hook(module, args, kwargs)
        return unit.post_forward_hook(module, args, kwargs, method(*args, **kwargs))

    setattr(module, method_name, as_forward)
