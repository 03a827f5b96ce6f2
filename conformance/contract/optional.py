"""Optional adapter methods: the one way the suite reaches them, with their defaults.

Methods added to the adapter protocol after version 1 are optional so that an
adapter written against an older protocol keeps loading and running. Each has
a function here, ``fn(adapter, ...)``: it calls the adapter's method when the
adapter defines one and applies the default otherwise. Cases and the plugin
call these functions, never ``getattr(adapter, ...)`` themselves.

========================================== ====================================================
adapter method (optional)                  default
========================================== ====================================================
``protocol_version: int``                  1
``activation_checkpoint_wrapper(m, offload)`` torch's ``checkpoint_wrapper`` / ``offload_wrapper``
``set_post_optim_event(model, event)``     unsupported: the case is ``n/a``
``wrapped_module(model)``                  ``model.module`` if it is a module, else ``model``
``full_grads(model)``                      ``None`` (not exposed: callers compare what they can)
``no_sync(model)``                         unsupported: the case is ``n/a``
``thread_rank_limits: Mapping[Capability, str]`` ``{}``: every capability holds on thread ranks too
``thread_rank_load_limits: Mapping[Capability, str]`` ``{}``: a state dict that saves on thread ranks loads there too
``fully_shard(module, mesh=..., ...)``     unsupported: the case is ``n/a``
``set_modules_to_prefetch(m, forward, backward)`` unsupported: the case is ``n/a``
``unshard(m, async_op)``, ``reshard(m)``   unsupported: the case is ``n/a``
``set_requires_gradient_sync(m, on)``      unsupported: the case is ``n/a``
``set_reshard_after_backward(m, on)``      unsupported: the case is ``n/a``
``set_reshard_after_forward(m, on, recurse)`` unsupported: the case is ``n/a``
``set_gradient_divide_factor(m, factor)``  unsupported: the case is ``n/a``
``set_reduce_scatter_divide_factor(m, f)`` unsupported: the case is ``n/a``
``set_requires_all_reduce(m, on)``, ``set_all_reduce_hook(m, hook)`` unsupported: the case is ``n/a``
``reset_iter_state(m)``                    unsupported: the case is ``n/a``
``set_is_last_backward(m, on)``, ``set_unshard_in_backward(m, on)``, ``register_forward_method(m, name)``,
``set_custom_comms(m, all_gather, reduce_scatter)``, ``set_reduce_scatter_unused_params(m, on)``
                                           unsupported: the case is ``n/a``
``performance_knobs: frozenset[str]``      none: each knob's row is ``n/a``
``param_dtypes: frozenset[torch.dtype]``   any: ``wrap`` takes a model's parameters in every dtype
``set_performance_knob(model, knob)``      (needed only with ``performance_knobs``)
``wrap_knobs``, ``knob_specs(base, knob)`` none: each such knob's row is ``n/a`` (wrap-time knobs)
``optimizer(model, cls, **kwargs)``        ``cls(model.parameters(), **kwargs)``
``step(model, optim)``                     ``optim.step()``
``step_zeroes_grads: bool`` (attribute)     ``False``: gradients outlive a step until ``zero_grad``
``supports_no_sync(strategy)``             whether ``NO_SYNC`` is declared
``full_optim_state_dict(m, o, ...)``, ``sharded_optim_state_dict``, ``shard_full_optim_state_dict``,
``scatter_full_optim_state_dict``, ``flatten_sharded_optim_state_dict``, ``rekey_optim_state_dict``
                                           unsupported: the case is ``n/a``
``set_state_dict_type(m, settings)``, ``get_state_dict_type(m)``, ``optim_state_dict_as_set(m, o)``,
``load_optim_state_dict_as_set(m, o, osd)``
                                           unsupported: the case is ``n/a``
``release(model)``                         nothing: dropping the model frees it
``units_per_module(strategy)``             ``True``: an auto-wrap policy makes a unit per module
``clip_grad_norm(m, max_norm, norm_type)``, ``apply_with_full_params(m, fn)``, ``check_is_root(unit)``,
``fsdp_modules(m, root_only)``, ``named_buffers(m)``, ``register_comm_hook(m, state, hook)``,
``summoned_params(m, path, ...)``           unsupported: the case is ``n/a``
========================================== ====================================================

Each default is what the suite did before the method existed, so an older
adapter sees no change. FSDP2's module controls are defined in :mod:`conformance.contract.module_controls`,
FSDP1's state-dict functions in :mod:`conformance.contract.state_dict_api`, FSDP1's methods on a wrapped model
in :mod:`conformance.contract.wrapper_methods`, the performance knobs in
:mod:`conformance.contract.knobs` and an engine's release, step and units in
:mod:`conformance.contract.optional_engine`; this module exports them, so ``optional.X`` stays the one way
to each. A capability that promises an optional method
(:data:`CAPABILITY_METHODS`) is refused at load without it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import DEPRECATED_CAPABILITIES, PROTOCOL_VERSION, Capability
from conformance.contract.knobs import knob_specs, performance_knobs, set_performance_knob, wrap_knobs
from conformance.contract.module_controls import (
    CONTROL_METHODS,
    FullyShardUnsupported,
    fully_shard,
    register_forward_method,
    reset_iter_state,
    reshard,
    set_all_reduce_hook,
    set_custom_comms,
    set_gradient_divide_factor,
    set_is_last_backward,
    set_modules_to_prefetch,
    set_reduce_scatter_divide_factor,
    set_reduce_scatter_unused_params,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    set_unshard_in_backward,
    unshard,
)
from conformance.contract.optional_engine import release, step_zeroes_grads, units_per_module
from conformance.contract.state_dict_api import (
    StateDictAPIUnsupported,
    flatten_sharded_optim_state_dict,
    full_optim_state_dict,
    get_state_dict_type,
    load_optim_state_dict_as_set,
    optim_state_dict_as_set,
    rekey_optim_state_dict,
    scatter_full_optim_state_dict,
    set_state_dict_type,
    shard_full_optim_state_dict,
    sharded_optim_state_dict,
)
from conformance.contract.wrapper_methods import (
    WrapperMethodUnsupported,
    apply_with_full_params,
    check_is_root,
    clip_grad_norm,
    fsdp_modules,
    named_buffers,
    register_comm_hook,
    summoned_params,
)

__all__ = [
    "CAPABILITY_METHODS", "LOADED_STATE_DICTS", "FullyShardUnsupported", "NoSyncUnsupported",
    "PostOptimEventUnsupported", "StateDictAPIUnsupported", "flatten_sharded_optim_state_dict",
    "full_optim_state_dict", "get_state_dict_type", "load_optim_state_dict_as_set", "optim_state_dict_as_set",
    "rekey_optim_state_dict", "scatter_full_optim_state_dict", "set_state_dict_type", "shard_full_optim_state_dict",
    "sharded_optim_state_dict", "activation_checkpoint_wrapper", "capabilities_of", "full_grads", "fully_shard",
    "no_sync", "optimizer", "performance_knobs", "knob_specs", "wrap_knobs", "protocol_version", "release",
    "reshard", "set_modules_to_prefetch", "set_performance_knob", "set_requires_gradient_sync",
    "set_gradient_divide_factor", "set_reduce_scatter_divide_factor", "set_requires_all_reduce",
    "set_all_reduce_hook", "reset_iter_state", "set_is_last_backward", "set_unshard_in_backward",
    "register_forward_method", "set_custom_comms", "set_reduce_scatter_unused_params", "set_reshard_after_backward",
    "set_reshard_after_forward", "step", "step_zeroes_grads", "supports_no_sync", "takes_param_dtype",
    "units_per_module", "unshard", "thread_rank_limits", "thread_rank_load_limits", "set_post_optim_event",
    "wrapped_module", "WrapperMethodUnsupported", "apply_with_full_params", "check_is_root", "clip_grad_norm",
    "fsdp_modules", "named_buffers", "register_comm_hook", "summoned_params",
]


#: A capability -> the optional methods an adapter declaring it must define (checked at load).
CAPABILITY_METHODS: dict[Capability, tuple[str, ...]] = {
    Capability.POST_OPTIM_EVENT: ("set_post_optim_event",),
    Capability.NO_SYNC: ("no_sync",),
    **CONTROL_METHODS,
    Capability.OPTIM_STATE_DICT_FUNCTIONS: ("full_optim_state_dict", "sharded_optim_state_dict",
                                            "shard_full_optim_state_dict", "scatter_full_optim_state_dict",
                                            "flatten_sharded_optim_state_dict", "rekey_optim_state_dict"),
    Capability.STATE_DICT_SETTINGS: ("set_state_dict_type", "get_state_dict_type", "optim_state_dict_as_set",
                                     "load_optim_state_dict_as_set"),
    Capability.LOCAL_STATE_DICT: ("set_state_dict_type", "get_state_dict_type", "optim_state_dict_as_set",
                                  "load_optim_state_dict_as_set"),
    Capability.WRAPPER_METHODS: ("clip_grad_norm", "apply_with_full_params", "check_is_root", "fsdp_modules",
                                 "named_buffers", "register_comm_hook"),
}


class PostOptimEventUnsupported(NotImplementedError):
    """The adapter has no post-optimizer event (cases report ``n/a``)."""


class NoSyncUnsupported(NotImplementedError):
    """The adapter cannot accumulate gradients without communication (cases report ``n/a``)."""



def protocol_version(adapter: Any) -> int:
    """The protocol version the adapter was written for (1 when it does not say)."""
    version = getattr(adapter, "protocol_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TypeError(f"adapter {getattr(adapter, 'name', adapter)!r}: protocol_version must be an int >= 1, "
                        f"got {version!r}")
    if version > PROTOCOL_VERSION:
        raise ValueError(f"adapter {getattr(adapter, 'name', adapter)!r} needs adapter protocol {version}; "
                         f"this suite speaks {PROTOCOL_VERSION}: upgrade fsdp-conformance")
    return version


def capabilities_of(adapter: Any) -> frozenset[Capability]:
    """The adapter's capabilities with deprecated names replaced by what they stand for, or dropped
    where the suite no longer asks for them (:data:`DEPRECATED_CAPABILITIES`).

    A deprecated capability warns (``DeprecationWarning``) naming its replacements, or why it is ignored.
    """
    declared = frozenset(adapter.capabilities)
    out = set(declared)
    for old, new in DEPRECATED_CAPABILITIES.items():
        if old not in declared:
            continue
        if isinstance(new, str):
            advice = f"it is ignored: {new}"
        else:
            advice = f"declare {', '.join(sorted('Capability.' + c.name for c in new))} instead"
            out |= new
        warnings.warn(f"adapter {adapter.name!r} declares deprecated Capability.{old.name}; {advice}",
                      DeprecationWarning, stacklevel=2)
        out.discard(old)
    return frozenset(out)


def activation_checkpoint_wrapper(adapter: Any, module: nn.Module, *, offload: bool) -> nn.Module:
    """``module`` wrapped to recompute (``offload=False``) or CPU-offload (``offload=True``) its activations.

    An offloading wrapper must pack activations through
    ``torch.autograd.graph.save_on_cpu`` (looked up when it runs) so that cases can
    see the offload happen.
    """
    method = getattr(adapter, "activation_checkpoint_wrapper", None)
    if method is not None:
        return method(module, offload=offload)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    return offload_wrapper(module) if offload else checkpoint_wrapper(module)


def set_post_optim_event(adapter: Any, model: nn.Module, event: torch.Event) -> None:
    """Tell the implementation the optimizer step ended at ``event``, so the next all-gather waits on it.

    Raises :class:`PostOptimEventUnsupported` when the adapter has no such method.
    """
    method = getattr(adapter, "set_post_optim_event", None)
    if method is None:
        raise PostOptimEventUnsupported(f"{adapter.name} has no post-optimizer event")
    method(model, event)


def wrapped_module(adapter: Any, model: nn.Module) -> nn.Module:
    """The user's module inside what :meth:`wrap` returned (the model itself for in-place sharding)."""
    method = getattr(adapter, "wrapped_module", None)
    if method is not None:
        return method(model)
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def full_grads(adapter: Any, model: nn.Module) -> dict[str, torch.Tensor | None] | None:
    """Full, unsharded, averaged gradients keyed like :meth:`FSDPAdapter.full_params`, or ``None``.

    Optional part of the contract: an adapter may define
    ``full_grads(model) -> dict[str, Tensor | None] | None`` (collective: every
    rank calls it). ``None`` means the adapter cannot expose them for this wrap
    (no such method, or e.g. torch's FSDP1 with flat parameters); callers then
    compare what they can without them and say so.
    """
    method = getattr(adapter, "full_grads", None)
    return None if method is None else method(model)


def no_sync(adapter: Any, model: nn.Module) -> AbstractContextManager[Any]:
    """A context in which backwards on ``model`` (the root :meth:`wrap` returned) communicate nothing.

    Optional part of the contract: an adapter may define
    ``no_sync(model) -> ContextManager`` (FSDP1's ``model.no_sync()``): inside
    it, backward keeps each rank's gradient locally, unreduced; the first
    backward after it reduces what was kept together with its own, so the
    optimizer sees the mean over ranks of every micro-batch's gradient. Enter
    it on every rank alike. Raises :class:`NoSyncUnsupported` when the adapter
    has no such method.
    """
    method = getattr(adapter, "no_sync", None)
    if method is None:
        raise NoSyncUnsupported(f"{adapter.name} has no no_sync (gradient accumulation without communication)")
    return method(model)  # type: ignore[no-any-return]


def optimizer(
    adapter: Any, model: nn.Module, cls: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    """The optimizer that trains ``model`` (the root :meth:`wrap` returned): ``cls`` with ``kwargs``, as
    ``cls(model.parameters(), **kwargs)`` would be for the unwrapped module.

    Optional part of the contract: an adapter whose implementation owns the optimizer (DeepSpeed's engine
    wraps it to step its partitions) defines ``optimizer(model, cls, **kwargs)``; every case builds the
    optimizer of a wrapped model here and steps it with :func:`step`. What it returns answers
    ``zero_grad(set_to_none=...)`` as torch's optimizers do and is what the case hands to
    :meth:`FSDPAdapter.optim_state_dict`; an oracle (DDP, a local model) builds its torch optimizer itself.
    Raises ``TypeError`` naming ``cls`` when it is not an optimizer class.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer class must be a torch.optim.Optimizer subclass, got {cls!r}")
    method = getattr(adapter, "optimizer", None)
    if method is not None:
        return method(model, cls, **kwargs)  # type: ignore[no-any-return]
    return cls(model.parameters(), **kwargs)


def step(adapter: Any, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """One optimizer step of ``optim`` (made by :func:`optimizer` for ``model``) on the gradients backward left.

    Optional part of the contract: an adapter defines ``step(model, optim)`` where the implementation steps
    through its own entry point (DeepSpeed's ``engine.step()``); the default is ``optim.step()``.
    """
    method = getattr(adapter, "step", None)
    if method is not None:
        method(model, optim)
    else:
        optim.step()


def supports_no_sync(adapter: Any, strategy: str | None) -> bool:
    """Whether :func:`no_sync` holds for a model ``adapter`` wrapped with ``strategy`` (``None``: its default).

    Optional part of the contract: an adapter whose implementation accumulates without communication under
    some strategies only defines ``supports_no_sync(strategy) -> bool`` beside :attr:`Capability.NO_SYNC`
    (DeepSpeed's ``engine.no_sync`` holds at ZeRO stage 1, where gradients are not partitioned). The default
    is the capability itself. A row requiring ``NO_SYNC`` whose strategy this refuses is ``n/a``.
    """
    if Capability.NO_SYNC not in capabilities_of(adapter):
        return False
    method = getattr(adapter, "supports_no_sync", None)
    return True if method is None else bool(method(strategy))


def thread_rank_limits(adapter: Any) -> Mapping[Capability, str]:
    """Capabilities the adapter has on process ranks but not on thread ranks, each with the reason.

    Optional part of the contract: an adapter may define
    ``thread_rank_limits: Mapping[Capability, str]``. A thread-rank row
    requiring one of them is ``n/a`` with that reason; process-rank rows are
    unaffected. It states a limit of the implementation when its ranks share
    one process (process-global state, say), not a feature, so it is not a
    capability of its own. Raises ``TypeError`` naming a key that is not a
    declared :class:`Capability`.
    """
    limits = dict(getattr(adapter, "thread_rank_limits", {}))
    declared = capabilities_of(adapter)
    bad = [key for key in limits if not isinstance(key, Capability) or key not in declared]
    if bad:
        raise TypeError(f"adapter {adapter.name!r}: thread_rank_limits keys must be capabilities it declares, "
                        f"got {bad!r}")
    return limits


#: The state-dict capabilities ``thread_rank_load_limits`` may name.
LOADED_STATE_DICTS = (Capability.FULL_STATE_DICT, Capability.SHARDED_STATE_DICT)


def thread_rank_load_limits(adapter: Any) -> Mapping[Capability, str]:
    """State-dict capabilities whose save holds on thread ranks but whose load does not, each with the reason.

    Optional part of the contract: an adapter may define
    ``thread_rank_load_limits: Mapping[Capability, str]``, keys among
    :data:`LOADED_STATE_DICTS`. It is narrower than :func:`thread_rank_limits`
    (which takes the whole capability off thread ranks): a caller that loads
    such a state dict on thread ranks treats the load as missing with that
    reason, and the saves still run. Raises ``TypeError`` naming a key that is
    not a declared state-dict capability.
    """
    limits = dict(getattr(adapter, "thread_rank_load_limits", {}))
    declared = capabilities_of(adapter)
    bad = [key for key in limits if key not in LOADED_STATE_DICTS or key not in declared]
    if bad:
        raise TypeError(f"adapter {adapter.name!r}: thread_rank_load_limits keys must be state-dict capabilities it "
                        f"declares ({', '.join(map(str, LOADED_STATE_DICTS))}), got {bad!r}")
    return limits


def takes_param_dtype(adapter: Any, dtype: torch.dtype) -> bool:
    """Whether the adapter's ``wrap`` takes a model whose parameters are in ``dtype``.

    Optional part of the contract: an adapter may define ``param_dtypes: frozenset[torch.dtype]``, the
    parameter dtypes its implementation accepts, where it refuses others at wrap time by design. A fuzz
    program or example of another dtype is not drawn, and a fixed one is ``n/a``. Default: every dtype.
    """
    dtypes: Any = getattr(adapter, "param_dtypes", None)
    if dtypes is None:
        return True
    if not isinstance(dtypes, (set, frozenset)) or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise TypeError(f"adapter {getattr(adapter, 'name', adapter)!r}: param_dtypes must be a set of "
                        f"torch dtypes, got {dtypes!r}")
    return dtype in dtypes
