"""The adapter contract: how a case drives an FSDP implementation.

A case never imports an FSDP directly. It asks the adapter to wrap a module for
a :class:`WrapSpec`, to enumerate the resulting units, to summon full
parameters, and to save/load state dicts. What an implementation cannot express
is declared up front in :attr:`FSDPAdapter.capabilities`; a case that needs a
missing capability is reported *not applicable* naming that capability, never
passed.

Adapters are looked up by name through the ``fsdp_conformance.adapters`` entry
point group (see :mod:`conformance.contract.registry`). Process ranks receive the adapter
by pickling, so an adapter must be a module-level class whose instances hold
only plain data.

The protocol is versioned (:data:`PROTOCOL_VERSION`). :class:`FSDPAdapter`
lists the methods every adapter has; methods added since version 1 are
optional, have defaults, and are reached through the functions in
:mod:`conformance.contract.optional`. Renamed and removed capabilities stay
accepted (:data:`DEPRECATED_CAPABILITIES`) with a ``DeprecationWarning``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from conformance.contract.capabilities import Capability
from conformance.contract.plan import AutoWrap
from conformance.contract.units import UnitInfo

__all__ = ["PROTOCOL_VERSION", "DEPRECATED_CAPABILITIES", "Capability", "STRATEGIES", "HYBRID_STRATEGIES",
           "DEFAULT_STRATEGY", "AutoWrap", "MixedPrecisionSpec", "WrapSpec", "UnitInfo", "FSDPAdapter"]

#: Version of the adapter protocol this suite speaks. 1: the methods of :class:`FSDPAdapter`.
#: 2: optional methods (:mod:`conformance.contract.optional`), fine-grained capabilities.
#: 3: ``WrapSpec.auto_wrap`` plans by submodule name (:class:`AutoWrap`, [Note: plans for older adapters]
#: in :mod:`conformance.contract.declared`).
PROTOCOL_VERSION = 3

#: Strategy names as ``torch.distributed.fsdp.ShardingStrategy`` spells them.
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
#: The strategy of a :class:`WrapSpec` that names none, and so of every row that declares none: such a row
#: asks the adapter's ``supports_strategy`` for it like any other ([Note: a row's strategies] in
#: :mod:`conformance.contract.case`).
DEFAULT_STRATEGY = "FULL_SHARD"


_THREAD_RANK_LIMITS = ("a declared capability holds on thread ranks unless the adapter lists it, with the reason, "
                       "in thread_rank_limits")
#: A capability no longer in use -> the capabilities it stands for now, or, where the suite no longer
#: asks an adapter for it, why it is ignored (docs/ADAPTER_GUIDE.md, section 8).
DEPRECATED_CAPABILITIES: dict[Capability, frozenset[Capability] | str] = {
    Capability.DEVICE_ID: frozenset({Capability.COMPUTE_DEVICE, Capability.PLACEMENT_MESSAGES}),
    Capability.FLAT_PARAM_INTROSPECTION: frozenset({Capability.RESHARD_INTROSPECTION}),
    Capability.PARAM_INIT_FN: frozenset({Capability.META_MATERIALIZATION, Capability.PARAM_INIT_FUNCTION}),
    Capability.OPTIM_STATE_DICT_ON_THREADS: _THREAD_RANK_LIMITS,
    Capability.FULL_STATE_DICT_LOAD_ON_THREADS: _THREAD_RANK_LIMITS,
}


@dataclass(frozen=True)
class MixedPrecisionSpec:
    """Dtypes for a wrap, in ``torch.distributed.fsdp.MixedPrecision`` terms (``None``: unchanged).

    ``param_dtype``: unsharded parameters (what all-gathers carry and forward and
    backward compute in); ``reduce_dtype``: gradient reduction (``None``: the
    param dtype); ``buffer_dtype``: buffers during compute;
    ``keep_low_precision_grads``: leave gradients in the param dtype for the optimizer.
    ``cast_forward_inputs``: the root casts floating forward inputs to ``param_dtype``
    (:attr:`Capability.MP_CAST_FORWARD_INPUTS`; the default, as torch's FSDP1 and FSDP2 do by
    default). ``False`` says the case feeds its inputs in ``param_dtype`` itself and relies on no
    cast: an implementation may then cast or not, which for such inputs is the same.
    ``output_dtype`` (FSDP2's, given to ``fully_shard`` only; :attr:`Capability.MP_OUTPUT_DTYPE`): the module's
    floating forward outputs are cast to it.
    ``cast_unit_forward_inputs``: every unit casts them too, not only the root (FSDP1's
    ``cast_forward_inputs``; :attr:`Capability.MP_CAST_UNIT_FORWARD_INPUTS`); ``False`` relies on no such cast.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = True
    output_dtype: torch.dtype | None = None
    cast_unit_forward_inputs: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecisionSpec.{name} must be a floating torch.dtype or None, got {value!r}")

    def required(self) -> list[Capability]:
        """The capabilities an adapter needs to express this spec."""
        caps = [Capability.MIXED_PRECISION]
        if self.buffer_dtype is not None:
            caps.append(Capability.MP_BUFFER_DTYPE)
        if self.keep_low_precision_grads:
            caps.append(Capability.MP_KEEP_LOW_PRECISION_GRADS)
        if self.cast_forward_inputs:
            caps.append(Capability.MP_CAST_FORWARD_INPUTS)
        if self.output_dtype is not None:
            caps.append(Capability.MP_OUTPUT_DTYPE)
        if self.cast_unit_forward_inputs:
            caps.append(Capability.MP_CAST_UNIT_FORWARD_INPUTS)
        return caps


@dataclass(frozen=True)
class WrapSpec:
    """Everything a case can ask of a wrap, in ``FullyShardedDataParallel`` terms.

    ``strategy=None`` means "the implementation's default". ``process_group`` is
    a group, or a ``(shard, replicate)`` tuple for hybrid strategies.
    ``device_mesh`` is a 1-D or 2-D (replicate, shard) mesh. ``extra`` passes
    implementation-specific keyword arguments through untouched.
    """

    strategy: str | None = DEFAULT_STRATEGY
    auto_wrap: AutoWrap | None = None
    process_group: Any = None
    device_mesh: Any = None
    device_id: torch.device | int | None = None
    cpu_offload: bool = False
    use_orig_params: bool = False
    sync_module_states: bool = False
    ignored_modules: Sequence[nn.Module] = ()
    ignored_states: Sequence[nn.Parameter | nn.Module] = ()
    param_init_fn: Callable[[nn.Module], None] | None = None
    forward_prefetch: bool = False
    backward_prefetch: str | None = "BACKWARD_PRE"
    limit_all_gathers: bool = True
    mixed_precision: MixedPrecisionSpec | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; expected one of {STRATEGIES}")
        if self.backward_prefetch not in (None, "BACKWARD_PRE", "BACKWARD_POST"):
            raise ValueError(
                f"backward_prefetch must be None, 'BACKWARD_PRE' or 'BACKWARD_POST', "
                f"got {self.backward_prefetch!r}"
            )

    @property
    def is_hybrid(self) -> bool:
        return self.strategy in HYBRID_STRATEGIES

    def required(self) -> list[Capability]:
        """The capabilities an adapter needs to express this spec (beyond a plain default wrap).

        A case's ``requires`` must include them: a wrap asking for more than the
        row declared is an error in the case (see :mod:`conformance.contract.declared`).
        """
        caps = [] if self.mixed_precision is None else self.mixed_precision.required()
        flags = {
            Capability.SYNC_MODULE_STATES: self.sync_module_states,
            Capability.PARAM_INIT_FUNCTION: self.param_init_fn is not None,
            Capability.CPU_OFFLOAD: self.cpu_offload,
            Capability.IGNORED_MODULES: bool(self.ignored_modules),
            Capability.IGNORED_STATES: bool(self.ignored_states),
            Capability.DEVICE_MESH: self.device_mesh is not None,
            Capability.HYBRID_VIA_PG_TUPLE: isinstance(self.process_group, tuple),
            Capability.BACKWARD_PREFETCH: self.backward_prefetch != "BACKWARD_PRE",
        }
        return caps + [capability for capability, used in flags.items() if used]


def optional_method(missing: type[Exception], adapter: Any, name: str, purpose: str = "") -> Callable[..., Any]:
    """The adapter's optional method ``name``, or ``missing`` raised naming the adapter, the method and what
    it is ``purpose``-d for (an ``n/a`` case): the one lookup behind each family of optional methods
    (:mod:`conformance.contract.module_controls`, :mod:`~conformance.contract.state_dict_api`,
    :mod:`~conformance.contract.wrapper_methods`)."""
    method = getattr(adapter, name, None)
    if method is None:
        raise missing(f"{adapter.name} has no {name}{purpose}")
    return method  # type: ignore[no-any-return]


@runtime_checkable
class FSDPAdapter(Protocol):
    """What the suite needs from an FSDP implementation."""

    name: str
    capabilities: frozenset[Capability]

    def unavailable_reason(self) -> str | None:
        """``None`` when importable and usable here, else why not (shown by ``impls``)."""

    def supports_strategy(self, strategy: str | None) -> bool:
        """Whether :meth:`wrap` can express ``strategy`` at all (``None``: the implementation's default).

        Consulted before ranks start: a case row whose strategy is unsupported is ``n/a``.
        """

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        """Shard ``module`` according to ``spec`` and return the root to train.

        ``spec.process_group=None`` means the default (world) group. Called on
        every rank alike; what it builds lives until the case ends (the harness
        destroys the case's groups; nothing else is torn down for the adapter).
        """

    def units(self, model: nn.Module) -> list[UnitInfo]:
        """Every unit of a wrapped model, root first then in module order."""

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Copies of every full, unsharded parameter, keyed as the unwrapped module names them."""

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Unflattened, unpadded state dict with the unwrapped module's keys, on every rank."""

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """This rank's shards, loadable into a model of the same layout."""

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        """Load the output of :meth:`full_state_dict` / :meth:`sharded_state_dict`."""

    def optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool
    ) -> dict[str, Any]:
        """Optimizer state keyed by original parameter names."""

    def load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state: dict[str, Any],
        *,
        sharded: bool,
    ) -> None:
        """Load the output of :meth:`optim_state_dict` into ``optim``."""
