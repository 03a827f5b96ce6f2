"""FSDP2's per-module controls as optional adapter methods: the functions :mod:`conformance.contract.optional`
exports (its table gives each default), defined here by family.

Each calls the adapter's method of the same name and raises :class:`FullyShardUnsupported` when the adapter
has none, so the case is ``n/a``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import MixedPrecisionSpec

__all__ = ["FullyShardUnsupported", "fully_shard", "reset_iter_state", "reshard", "set_all_reduce_hook",
           "set_gradient_divide_factor", "set_modules_to_prefetch", "set_reduce_scatter_divide_factor",
           "set_requires_all_reduce", "set_requires_gradient_sync", "set_reshard_after_backward",
           "set_reshard_after_forward", "unshard"]


class FullyShardUnsupported(NotImplementedError):
    """The adapter has no per-module sharding in FSDP2's shape, or no explicit prefetch (cases report ``n/a``)."""


def fully_shard(
    adapter: Any,
    module: nn.Module,
    *,
    mesh: Any,
    reshard_after_forward: bool | int = True,
    ignored_params: Iterable[nn.Parameter] = (),
    mixed_precision: MixedPrecisionSpec | None = None,
    dp_mesh_dims: tuple[str, str] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters not owned by an already sharded submodule over ``mesh`` (FSDP2's
    ``fully_shard``; call it bottom-up, the root last) and return the module.

    Optional part of the contract (:attr:`Capability.FULLY_SHARD`): the adapter defines
    ``fully_shard(module, *, mesh, reshard_after_forward, ignored_params)``. ``ignored_params`` stay
    unsharded and unreduced. ``mixed_precision`` is passed on only when given (an adapter declaring
    :attr:`Capability.FULLY_SHARD_MIXED_PRECISION` takes it as a keyword), so an adapter without mixed
    precision keeps its signature; so is ``dp_mesh_dims``, the names of ``mesh``'s shard and replicate dims
    (:attr:`Capability.FULLY_SHARD_DP_MESH_DIMS`). Raises :class:`FullyShardUnsupported` when the adapter has
    no such method.
    """
    method = getattr(adapter, "fully_shard", None)
    if method is None:
        raise FullyShardUnsupported(f"{adapter.name} has no fully_shard (per-module sharding)")
    policy: dict[str, Any] = {} if mixed_precision is None else {"mixed_precision": mixed_precision}
    policy.update({} if dp_mesh_dims is None else {"dp_mesh_dims": dp_mesh_dims})
    return method(  # type: ignore[no-any-return]
        module, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=frozenset(ignored_params),
        **policy,
    )


def set_modules_to_prefetch(
    adapter: Any,
    module: nn.Module,
    *,
    forward: Sequence[nn.Module] | None = None,
    backward: Sequence[nn.Module] | None = None,
) -> None:
    """After ``module``'s own all-gather in forward (backward), all-gather those of ``forward``
    (``backward``), ``fully_shard``-ed modules, in that order (``None``: leave as is).

    Optional part of the contract (:attr:`Capability.EXPLICIT_PREFETCH`): the adapter defines
    ``set_modules_to_prefetch(module, *, forward, backward)`` (FSDP2's
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``). Raises
    :class:`FullyShardUnsupported` when it does not.
    """
    method = getattr(adapter, "set_modules_to_prefetch", None)
    if method is None:
        raise FullyShardUnsupported(f"{adapter.name} has no explicit prefetch lists")
    method(module, forward=forward, backward=backward)


def _control(adapter: Any, name: str) -> Any:
    method = getattr(adapter, name, None)
    if method is None:
        raise FullyShardUnsupported(f"{adapter.name} has no {name} for a fully_shard-ed module")
    return method


def unshard(adapter: Any, module: nn.Module, *, async_op: bool = False) -> Any:
    """All-gather the ``fully_shard``-ed ``module``'s own parameters (not its submodules') for its next
    forward; with ``async_op`` return a handle whose ``wait()`` the caller calls before that forward,
    else ``None`` once they are gathered (FSDP2's ``FSDPModule.unshard``).

    Optional part of the contract (:attr:`Capability.FULLY_SHARD_CONTROLS`), as the three below. Each
    raises :class:`FullyShardUnsupported` when the adapter lacks the method.
    """
    return _control(adapter, "unshard")(module, async_op=async_op)


def reshard(adapter: Any, module: nn.Module) -> None:
    """Free the ``fully_shard``-ed ``module``'s own unsharded parameters (FSDP2's ``FSDPModule.reshard``)."""
    _control(adapter, "reshard")(module)


def set_requires_gradient_sync(adapter: Any, module: nn.Module, on: bool) -> None:
    """Whether backwards reduce the gradients of ``module`` and every ``fully_shard``-ed module under it:
    off, each rank keeps its own gradient, unreduced, and adds it to the next reduced one (FSDP2's
    ``set_requires_gradient_sync``, as :func:`no_sync`)."""
    _control(adapter, "set_requires_gradient_sync")(module, on)


def set_reshard_after_backward(adapter: Any, module: nn.Module, on: bool) -> None:
    """Whether backward frees the unsharded parameters of ``module`` and every ``fully_shard``-ed module
    under it (off: the next forward may reuse them; FSDP2's ``set_reshard_after_backward``)."""
    _control(adapter, "set_reshard_after_backward")(module, on)


def set_reshard_after_forward(adapter: Any, module: nn.Module, on: bool, *, recurse: bool = True) -> None:
    """Whether forward frees the unsharded parameters of ``module`` (and, with ``recurse``, of every
    ``fully_shard``-ed module under it): off, backward needs no all-gather for them (FSDP2's
    ``set_reshard_after_forward``; :attr:`Capability.SET_RESHARD_AFTER_FORWARD`)."""
    _control(adapter, "set_reshard_after_forward")(module, on, recurse=recurse)


def set_gradient_divide_factor(adapter: Any, module: nn.Module, factor: float) -> None:
    """The reduction of ``module``'s own parameters' gradients (not its submodules') divides the sum over ranks by
    ``factor`` instead of the world size (FSDP2's ``set_gradient_divide_factor``;
    :attr:`Capability.GRADIENT_DIVIDE_FACTOR`)."""
    _control(adapter, "set_gradient_divide_factor")(module, factor)


def set_reduce_scatter_divide_factor(adapter: Any, module: nn.Module, factor: float) -> None:
    """FSDP2's deprecated alias of :func:`set_gradient_divide_factor`, which it behaves as
    (:attr:`Capability.REDUCE_SCATTER_DIVIDE_FACTOR`; its ``DeprecationWarning`` is not a failure)."""
    _control(adapter, "set_reduce_scatter_divide_factor")(module, factor)


def set_requires_all_reduce(adapter: Any, module: nn.Module, on: bool) -> None:
    """Whether backwards all-reduce the gradients of ``module`` and every ``fully_shard``-ed module under it over
    the replicas of a 2-D mesh: off, they reduce-scatter only and the sums add up until a backward with it on
    (FSDP2's ``set_requires_all_reduce``; :attr:`Capability.ALL_REDUCE_CONTROLS`, as the one below)."""
    _control(adapter, "set_requires_all_reduce")(module, on)


def set_all_reduce_hook(adapter: Any, module: nn.Module, hook: Callable[[torch.Tensor], None]) -> None:
    """Run ``hook(reduce_output)`` on ``module``'s all-reduced gradient, before it reaches the optimizer; what
    the hook writes in place is what the optimizer sees (FSDP2's ``set_all_reduce_hook``)."""
    _control(adapter, "set_all_reduce_hook")(module, hook)


def reset_iter_state(adapter: Any, module: nn.Module) -> None:
    """After an exception raised mid forward or backward, reset the root ``module``'s per-iteration state so
    that the next iteration trains as a fresh one (FSDP2's ``reset_iter_state``;
    :attr:`Capability.RESET_ITER_STATE`)."""
    _control(adapter, "reset_iter_state")(module)
