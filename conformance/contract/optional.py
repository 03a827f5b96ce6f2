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
``performance_knobs: frozenset[str]``      none: each knob's row is ``n/a``
``set_performance_knob(model, knob)``      (needed only with ``performance_knobs``)
``optimizer(model, cls, **kwargs)``        ``cls(model.parameters(), **kwargs)``
``step(model, optim)``                     ``optim.step()``
``supports_no_sync(strategy)``             whether ``NO_SYNC`` is declared
``full_optim_state_dict(m, o, ...)``, ``sharded_optim_state_dict``, ``shard_full_optim_state_dict``,
``scatter_full_optim_state_dict``, ``flatten_sharded_optim_state_dict``, ``rekey_optim_state_dict``
                                           unsupported: the case is ``n/a``
``set_state_dict_type(m, settings)``, ``get_state_dict_type(m)``, ``optim_state_dict_as_set(m, o)``,
``load_optim_state_dict_as_set(m, o, osd)``
                                           unsupported: the case is ``n/a``
========================================== ====================================================

Each default is what the suite did before the method existed, so an older
adapter sees no change. A capability that promises an optional method
(:data:`CAPABILITY_METHODS`) is refused at load without it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import (
    DEPRECATED_CAPABILITIES,
    PROTOCOL_VERSION,
    Capability,
    MixedPrecisionSpec,
    StateDictSettingsSpec,
)

__all__ = [
    "CAPABILITY_METHODS",
    "LOADED_STATE_DICTS",
    "FullyShardUnsupported",
    "NoSyncUnsupported",
    "PostOptimEventUnsupported",
    "StateDictAPIUnsupported",
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "get_state_dict_type",
    "load_optim_state_dict_as_set",
    "optim_state_dict_as_set",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "set_state_dict_type",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
    "activation_checkpoint_wrapper",
    "capabilities_of",
    "full_grads",
    "fully_shard",
    "no_sync",
    "optimizer",
    "performance_knobs",
    "protocol_version",
    "reshard",
    "set_modules_to_prefetch",
    "set_performance_knob",
    "set_requires_gradient_sync",
    "set_gradient_divide_factor",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "step",
    "supports_no_sync",
    "unshard",
    "thread_rank_limits",
    "thread_rank_load_limits",
    "set_post_optim_event",
    "wrapped_module",
]


#: A capability -> the optional methods an adapter declaring it must define (checked at load).
CAPABILITY_METHODS: dict[Capability, tuple[str, ...]] = {
    Capability.POST_OPTIM_EVENT: ("set_post_optim_event",),
    Capability.NO_SYNC: ("no_sync",),
    Capability.FULLY_SHARD: ("fully_shard",),
    Capability.EXPLICIT_PREFETCH: ("set_modules_to_prefetch",),
    Capability.FULLY_SHARD_CONTROLS: ("unshard", "reshard", "set_requires_gradient_sync",
                                      "set_reshard_after_backward"),
    Capability.SET_RESHARD_AFTER_FORWARD: ("set_reshard_after_forward",),
    Capability.GRADIENT_DIVIDE_FACTOR: ("set_gradient_divide_factor",),
    Capability.OPTIM_STATE_DICT_FUNCTIONS: ("full_optim_state_dict", "sharded_optim_state_dict",
                                            "shard_full_optim_state_dict", "scatter_full_optim_state_dict",
                                            "flatten_sharded_optim_state_dict", "rekey_optim_state_dict"),
    Capability.STATE_DICT_SETTINGS: ("set_state_dict_type", "get_state_dict_type", "optim_state_dict_as_set",
                                     "load_optim_state_dict_as_set"),
}


class PostOptimEventUnsupported(NotImplementedError):
    """The adapter has no post-optimizer event (cases report ``n/a``)."""


class NoSyncUnsupported(NotImplementedError):
    """The adapter cannot accumulate gradients without communication (cases report ``n/a``)."""


class StateDictAPIUnsupported(NotImplementedError):
    """The adapter lacks one of FSDP1's state-dict functions or settings (cases report ``n/a``)."""


class FullyShardUnsupported(NotImplementedError):
    """The adapter has no per-module sharding in FSDP2's shape, or no explicit prefetch (cases report ``n/a``)."""


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


def fully_shard(
    adapter: Any,
    module: nn.Module,
    *,
    mesh: Any,
    reshard_after_forward: bool | int = True,
    ignored_params: Iterable[nn.Parameter] = (),
    mixed_precision: MixedPrecisionSpec | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters not owned by an already sharded submodule over ``mesh`` (FSDP2's
    ``fully_shard``; call it bottom-up, the root last) and return the module.

    Optional part of the contract (:attr:`Capability.FULLY_SHARD`): the adapter defines
    ``fully_shard(module, *, mesh, reshard_after_forward, ignored_params)``. ``ignored_params`` stay
    unsharded and unreduced. ``mixed_precision`` is passed on only when given (an adapter declaring
    :attr:`Capability.FULLY_SHARD_MIXED_PRECISION` takes it as a keyword), so an adapter without mixed
    precision keeps its signature. Raises :class:`FullyShardUnsupported` when the adapter has no such method.
    """
    method = getattr(adapter, "fully_shard", None)
    if method is None:
        raise FullyShardUnsupported(f"{adapter.name} has no fully_shard (per-module sharding)")
    policy = {} if mixed_precision is None else {"mixed_precision": mixed_precision}
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


def performance_knobs(adapter: Any) -> frozenset[str]:
    """The names of the performance knobs the adapter turns on itself, after a wrap ([Note: performance knobs]
    in :mod:`conformance.cases.test_neutrality`, which lists every name a row exists for); none by default."""
    knobs: Any = getattr(adapter, "performance_knobs", frozenset())
    if not isinstance(knobs, (set, frozenset)) or not all(isinstance(knob, str) for knob in knobs):
        raise TypeError(f"adapter {getattr(adapter, 'name', adapter)!r}: performance_knobs must be a set of "
                        f"knob names, got {knobs!r}")
    return frozenset(knobs)


def set_performance_knob(adapter: Any, model: nn.Module, knob: str) -> None:
    """Turn ``knob`` (one of :func:`performance_knobs`) on for every unit of the wrapped ``model``."""
    if knob not in performance_knobs(adapter):
        raise ValueError(f"adapter {getattr(adapter, 'name', adapter)!r} offers no performance knob {knob!r}")
    adapter.set_performance_knob(model, knob)


def _state_dict_api(adapter: Any, name: str) -> Any:
    method = getattr(adapter, name, None)
    if method is None:
        raise StateDictAPIUnsupported(f"{adapter.name} has no {name}")
    return method


def full_optim_state_dict(
    adapter: Any, model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool, group: Any = None
) -> dict[str, Any]:
    """The full optimizer state of the wrapped ``model``, keyed by parameter names as FSDP1's
    ``full_optim_state_dict(model, optim, rank0_only=..., group=...)`` returns it (collective; with
    ``rank0_only`` ranks other than 0 get ``{}``).

    Optional part of the contract (:attr:`Capability.OPTIM_STATE_DICT_FUNCTIONS`), as the five below. Each
    raises :class:`StateDictAPIUnsupported` when the adapter lacks the method.
    """
    return _state_dict_api(adapter, "full_optim_state_dict")(  # type: ignore[no-any-return]
        model, optim, rank0_only=rank0_only, group=group)


def sharded_optim_state_dict(adapter: Any, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's share of the optimizer state, keyed by parameter names (FSDP1's ``sharded_optim_state_dict``)."""
    return _state_dict_api(adapter, "sharded_optim_state_dict")(model, optim)  # type: ignore[no-any-return]


def shard_full_optim_state_dict(
    adapter: Any, full_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """``full_osd`` (a full optimizer state dict keyed by names) as ``optim.load_state_dict`` takes it for the
    wrapped ``model`` (FSDP1's ``shard_full_optim_state_dict(full_osd, model, optim=optim)``)."""
    return _state_dict_api(adapter, "shard_full_optim_state_dict")(  # type: ignore[no-any-return]
        full_osd, model, optim)


def scatter_full_optim_state_dict(
    adapter: Any, full_osd: dict[str, Any] | None, model: nn.Module, optim: torch.optim.Optimizer, *, group: Any = None
) -> dict[str, Any]:
    """Rank 0's ``full_osd`` (ignored on other ranks) as each rank's ``optim`` loads it (collective; FSDP1's
    ``scatter_full_optim_state_dict(full_osd, model, optim=optim, group=group)``)."""
    return _state_dict_api(adapter, "scatter_full_optim_state_dict")(  # type: ignore[no-any-return]
        full_osd, model, optim, group=group)


def flatten_sharded_optim_state_dict(
    adapter: Any, sharded_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """What :func:`sharded_optim_state_dict` returned, as ``optim.load_state_dict`` takes it (FSDP1's
    ``flatten_sharded_optim_state_dict``)."""
    return _state_dict_api(adapter, "flatten_sharded_optim_state_dict")(  # type: ignore[no-any-return]
        sharded_osd, model, optim)


def rekey_optim_state_dict(
    adapter: Any, osd: dict[str, Any], key_type: str, model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """``osd`` keyed by parameter names (``key_type="PARAM_NAME"``) or by positions in ``optim``'s parameter
    order (``"PARAM_ID"``), for ``model`` and its ``optim`` (FSDP1's ``rekey_optim_state_dict`` with
    ``OptimStateKeyType``)."""
    if key_type not in ("PARAM_NAME", "PARAM_ID"):
        raise ValueError(f"key_type must be PARAM_NAME or PARAM_ID, got {key_type!r}")
    return _state_dict_api(adapter, "rekey_optim_state_dict")(  # type: ignore[no-any-return]
        osd, key_type, model, optim)


def set_state_dict_type(
    adapter: Any, model: nn.Module, settings: StateDictSettingsSpec
) -> StateDictSettingsSpec | None:
    """Give every unit of the wrapped ``model`` ``settings``; the settings they held before (FSDP1's
    ``set_state_dict_type``, whose ``StateDictSettings`` the adapter describes as a
    :class:`StateDictSettingsSpec`).

    Optional part of the contract (:attr:`Capability.STATE_DICT_SETTINGS`), as the two below. Each raises
    :class:`StateDictAPIUnsupported` when the adapter lacks the method.
    """
    return _state_dict_api(adapter, "set_state_dict_type")(model, settings)  # type: ignore[no-any-return]


def get_state_dict_type(adapter: Any, model: nn.Module) -> StateDictSettingsSpec | None:
    """The settings the units of ``model`` hold (FSDP1's ``get_state_dict_type``)."""
    return _state_dict_api(adapter, "get_state_dict_type")(model)  # type: ignore[no-any-return]


def optim_state_dict_as_set(adapter: Any, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state dict in the type and with the options :func:`set_state_dict_type` set (FSDP1's
    ``optim_state_dict(model, optim)`` with no ``state_dict_type`` context around it)."""
    return _state_dict_api(adapter, "optim_state_dict_as_set")(model, optim)  # type: ignore[no-any-return]


def load_optim_state_dict_as_set(
    adapter: Any, model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]
) -> None:
    """Load what :func:`optim_state_dict_as_set` returned into ``optim``, in the type and with the options
    :func:`set_state_dict_type` set (FSDP1's ``optim_state_dict_to_load`` with no context around it)."""
    _state_dict_api(adapter, "load_optim_state_dict_as_set")(model, optim, osd)
