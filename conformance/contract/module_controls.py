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

from conformance.contract.adapter import Capability, MixedPrecisionSpec, optional_method

__all__ = ["CONTROL_METHODS", "FullyShardUnsupported", "fully_shard", "register_forward_method", "reset_iter_state",
           "reshard", "set_all_reduce_hook", "set_custom_comms", "set_gradient_divide_factor", "set_is_last_backward",
           "set_modules_to_prefetch", "set_reduce_scatter_divide_factor", "set_reduce_scatter_unused_params",
           "set_requires_all_reduce", "set_requires_gradient_sync", "set_reshard_after_backward",
           "set_reshard_after_forward", "set_unshard_in_backward", "unshard"]


#: A capability of FSDP2's module controls -> the optional methods an adapter declaring it must define (part of
#: :data:`conformance.contract.optional.CAPABILITY_METHODS`, checked at load).
CONTROL_METHODS: dict[Capability, tuple[str, ...]] = {
    Capability.FULLY_SHARD: ("fully_shard",),
    Capability.FULLY_SHARD_DP_MESH_DIMS: ("fully_shard",),
    Capability.FULLY_SHARD_TENSOR_PARALLEL: ("fully_shard",),
    Capability.EXPLICIT_PREFETCH: ("set_modules_to_prefetch",),
    Capability.FULLY_SHARD_CONTROLS: ("unshard", "reshard", "set_requires_gradient_sync",
                                      "set_reshard_after_backward"),
    Capability.SET_RESHARD_AFTER_FORWARD: ("set_reshard_after_forward",),
    Capability.GRADIENT_DIVIDE_FACTOR: ("set_gradient_divide_factor",),
    Capability.REDUCE_SCATTER_DIVIDE_FACTOR: ("set_reduce_scatter_divide_factor",),
    Capability.ALL_REDUCE_CONTROLS: ("set_requires_all_reduce", "set_all_reduce_hook"),
    Capability.RESET_ITER_STATE: ("reset_iter_state",),
    Capability.IS_LAST_BACKWARD: ("set_is_last_backward",),
    Capability.UNSHARD_IN_BACKWARD: ("set_unshard_in_backward",),
    Capability.CUSTOM_COMMS: ("set_custom_comms",),
    Capability.REDUCE_SCATTER_UNUSED_PARAMS: ("set_reduce_scatter_unused_params",),
    Capability.FORWARD_METHODS: ("register_forward_method",),
}

class FullyShardUnsupported(NotImplementedError):
    """The adapter has no per-module sharding in FSDP2's shape, or no explicit prefetch (cases report ``n/a``)."""


def fully_shard(
    adapter: Any,
    module: nn.Module | Sequence[nn.Module],
    *,
    mesh: Any,
    reshard_after_forward: bool | int = True,
    ignored_params: Iterable[nn.Parameter] = (),
    mixed_precision: MixedPrecisionSpec | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    dp_mesh_dims: tuple[str, str | None] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters not owned by an already sharded submodule over ``mesh`` (FSDP2's
    ``fully_shard``; call it bottom-up, the root last) and return the module; a list of modules is one
    group (:attr:`Capability.FULLY_SHARD_MODULE_GROUPS`).

    Optional part of the contract (:attr:`Capability.FULLY_SHARD`): the adapter defines
    ``fully_shard(module, *, mesh, reshard_after_forward, ignored_params)``. ``ignored_params`` stay
    unsharded and unreduced. ``mixed_precision`` is passed on only when given (an adapter declaring
    :attr:`Capability.FULLY_SHARD_MIXED_PRECISION` takes it as a keyword), so an adapter without mixed
    precision keeps its signature; likewise ``shard_placement_fn`` (:attr:`Capability.SHARD_PLACEMENT_FN`) and
    ``dp_mesh_dims``, the names of ``mesh``'s shard and replicate dims (:attr:`Capability.FULLY_SHARD_DP_MESH_DIMS`).
    Raises :class:`FullyShardUnsupported` when the adapter has no such method.
    """
    method = getattr(adapter, "fully_shard", None)
    if method is None:
        raise FullyShardUnsupported(f"{adapter.name} has no fully_shard (per-module sharding)")
    policy: dict[str, Any] = {} if mixed_precision is None else {"mixed_precision": mixed_precision}
    if shard_placement_fn is not None:
        policy["shard_placement_fn"] = shard_placement_fn
    if dp_mesh_dims is not None:
        policy["dp_mesh_dims"] = dp_mesh_dims
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


def _control(adapter: Any, name: str) -> Callable[..., Any]:
    return optional_method(FullyShardUnsupported, adapter, name, " for a fully_shard-ed module")


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


def set_is_last_backward(adapter: Any, module: nn.Module, on: bool) -> None:
    """Whether the root ``module``'s next backward is the last of its micro-batches: off, that backward need not
    finish its gradient reductions (the gradients are read after the last one); FSDP2's ``set_is_last_backward``
    (:attr:`Capability.IS_LAST_BACKWARD`)."""
    _control(adapter, "set_is_last_backward")(module, on)


def set_unshard_in_backward(adapter: Any, module: nn.Module, on: bool) -> None:
    """Whether backward all-gathers the ``fully_shard``-ed ``module``'s own parameters: off for a module whose
    parameters its backward does not read (an embedding), whose gradients are computed all the same (FSDP2's
    ``set_unshard_in_backward``; :attr:`Capability.UNSHARD_IN_BACKWARD`)."""
    _control(adapter, "set_unshard_in_backward")(module, on)


def register_forward_method(adapter: Any, module: nn.Module, method_name: str) -> None:
    """Make ``module.method_name`` of a ``fully_shard``-ed ``module`` run as ``forward`` does: its parameters are
    gathered for it (FSDP2's ``register_fsdp_forward_method``; :attr:`Capability.FORWARD_METHODS`)."""
    _control(adapter, "register_forward_method")(module, method_name)


def set_custom_comms(adapter: Any, module: nn.Module, *, all_gather: Any = None, reduce_scatter: Any = None) -> None:
    """Issue the ``fully_shard``-ed ``module``'s own all-gathers through ``all_gather`` and its reduce-scatters
    through ``reduce_scatter`` (``None``: as before), objects of torch's ``AllGather`` / ``ReduceScatter`` protocol
    (FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``; :attr:`Capability.CUSTOM_COMMS`)."""
    _control(adapter, "set_custom_comms")(module, all_gather=all_gather, reduce_scatter=reduce_scatter)


def set_reduce_scatter_unused_params(adapter: Any, module: nn.Module, on: bool) -> None:
    """Whether backward reduces, as zeros, the parameters of ``module`` and every ``fully_shard``-ed module under it
    that got no gradient on this rank, so that ranks may use different parameters in one backward (FSDP2's
    ``set_reduce_scatter_unused_params``; :attr:`Capability.REDUCE_SCATTER_UNUSED_PARAMS`)."""
    _control(adapter, "set_reduce_scatter_unused_params")(module, on)
