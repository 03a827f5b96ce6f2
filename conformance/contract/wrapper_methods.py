"""FSDP1's methods on a wrapped model as optional adapter methods: the functions
:mod:`conformance.contract.optional` exports (its table gives each default), defined here by family.

Each calls the adapter's method of the same name and raises :class:`WrapperMethodUnsupported` when the
adapter has none; a case reaching one requires the capability that promises it, so it is ``n/a`` before any
rank starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import optional_method

__all__ = ["WrapperMethodUnsupported", "apply_with_full_params", "check_is_root", "clip_grad_norm", "fsdp_modules",
           "named_buffers", "register_comm_hook", "summoned_params"]


class WrapperMethodUnsupported(NotImplementedError):
    """The adapter lacks one of FSDP1's wrapper methods (cases report ``n/a``)."""


_method = functools.partial(optional_method, WrapperMethodUnsupported)


def clip_grad_norm(adapter: Any, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip the gradients of the wrapped root ``model`` to total norm ``max_norm`` (the ``norm_type``-norm of
    every parameter's gradient, every rank's shards together, as one vector) and return that total norm, the
    same on every rank (collective; FSDP1's ``model.clip_grad_norm_(max_norm, norm_type)``).

    Optional part of the contract (:attr:`Capability.WRAPPER_METHODS`), as the five below. Each raises
    :class:`WrapperMethodUnsupported` when the adapter lacks the method.
    """
    return _method(adapter, "clip_grad_norm")(model, max_norm, norm_type)  # type: ignore[no-any-return]


def apply_with_full_params(adapter: Any, model: nn.Module, fn: Callable[[nn.Module], None]) -> None:
    """Call ``fn`` on every module of the wrapped ``model``, each seeing its full parameters, and keep what
    ``fn`` writes into them (collective; FSDP1's ``model.apply(fn)``, which gathers the full parameters)."""
    _method(adapter, "apply_with_full_params")(model, fn)


def check_is_root(adapter: Any, unit: nn.Module) -> bool:
    """Whether ``unit``, a unit of a wrapped model, is its root (FSDP1's ``unit.check_is_root()``)."""
    return bool(_method(adapter, "check_is_root")(unit))


def fsdp_modules(adapter: Any, model: nn.Module, *, root_only: bool) -> list[nn.Module]:
    """Every unit in ``model``'s tree, or only the roots with ``root_only`` (FSDP1's
    ``FullyShardedDataParallel.fsdp_modules(model, root_only)``): the modules the implementation returns."""
    return list(_method(adapter, "fsdp_modules")(model, root_only=root_only))


def named_buffers(adapter: Any, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Copies of what the wrapped ``model``'s own ``named_buffers()`` yields inside ``summon_full_params``
    (collective), names as the implementation gives them: FSDP1's override removes its wrapper prefixes there."""
    return list(_method(adapter, "named_buffers")(model))


def register_comm_hook(adapter: Any, model: nn.Module, state: object, hook: Callable[..., None]) -> None:
    """Register ``hook`` with ``state`` on the wrapped root ``model`` and every unit under it, before its first
    forward: it then reduces each unit's gradient in place of the implementation (FSDP1's
    ``model.register_comm_hook(state, hook)``): ``hook(state, grad)`` under ``NO_SHARD`` (``grad``: the unit's
    full flat gradient, reduced in place), ``hook(state, grad, output)`` under a sharded strategy (``grad``:
    the full flat gradient padded to a multiple of the shard group's size; ``output``: this rank's piece, which
    the hook fills). The gradient the optimizer sees is what the hook leaves, divided by nothing more.

    Torch refuses it for hybrid strategies; the suite registers none there.
    """
    _method(adapter, "register_comm_hook")(model, state, hook)


def summoned_params(adapter: Any, model: nn.Module, path: str, *, recurse: bool, rank0_only: bool,
                    offload_to_cpu: bool, with_grads: bool) -> tuple[dict[str, torch.Tensor],
                                                                   dict[str, torch.Tensor | None] | None]:
    """Copies of what the module at ``path`` of the wrapped root ``model`` (a path of the user's model; ``""``:
    the root) yields from ``named_parameters()`` inside ``summon_full_params(module, recurse=recurse,
    writeback=False, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu, with_grads=with_grads)``, named as
    :meth:`FSDPAdapter.full_params` names them (on the device they were on), and with ``with_grads`` their
    gradients (else ``None``). Collective.

    Optional beyond :attr:`Capability.WRAPPER_METHODS` (an adapter declaring it may lack this one): raises
    :class:`WrapperMethodUnsupported` when the adapter has no such method.
    """
    return _method(adapter, "summoned_params")(  # type: ignore[no-any-return]
        model, path, recurse=recurse, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu, with_grads=with_grads)
