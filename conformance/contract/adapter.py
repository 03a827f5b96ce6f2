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

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

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


class Capability(str, enum.Enum):
    """Behaviours a case may require; an adapter lists the ones it has."""

    EXEC_ORDER_VALIDATION = "exec_order_validation"
    """Checks, with debug level DETAIL, that ranks all-gather units in the same order."""
    FLAT_PARAM = "flat_param"
    """Can expose one flat parameter per unit (``use_orig_params=False``)."""
    MANUAL_NESTING = "manual_nesting"
    """FSDP1's manual nesting: ``wrap`` called on a submodule and then on a module holding it (each call
    with its own spec) nests the first unit in the second. A case that only needs units describes them as
    a plan (``WrapSpec.auto_wrap``) instead, which every adapter realises."""
    FLAT_PARAM_INTROSPECTION = "flat_param_introspection"
    """Deprecated (protocol 1): :attr:`RESHARD_INTROSPECTION`."""
    RESHARD_INTROSPECTION = "reshard_introspection"
    """:meth:`FSDPAdapter.units` reports whether each unit is resharded (``UnitInfo.resharded`` is not None)."""
    HYBRID_VIA_PG_TUPLE = "hybrid_via_pg_tuple"
    """Hybrid strategies accept a ``(shard_group, replicate_group)`` tuple."""
    HYBRID_AUTO_GROUPS = "hybrid_auto_groups"
    """Hybrid + auto-wrap with no group builds intra/inter-node groups itself."""
    HYBRID_MANUAL_WRAP_CHECK = "hybrid_manual_wrap_check"
    """Manual hybrid wrapping without groups raises the catalogued ValueError."""
    HYBRID_PG_VALIDATION = "hybrid_pg_validation"
    """A hybrid strategy given one (non-tuple) process group raises the catalogued ValueError."""
    SYNC_MODULE_STATES = "sync_module_states"
    """``WrapSpec.sync_module_states``: rank 0's parameters and buffers are broadcast at wrap time."""
    CPU_OFFLOAD = "cpu_offload"
    """``WrapSpec.cpu_offload``: sharded parameters and their gradients live on the CPU."""
    IGNORED_MODULES = "ignored_modules"
    """``WrapSpec.ignored_modules``: their parameters stay unsharded and unmanaged, and they and the
    ignored modules' buffers stay where they are (not moved to ``device_id``)."""
    PARAM_INIT_FN = "param_init_fn"
    """Deprecated: :attr:`META_MATERIALIZATION` and :attr:`PARAM_INIT_FUNCTION` together."""
    META_MATERIALIZATION = "meta_materialization"
    """``wrap`` accepts a module on the meta device and materializes it onto the compute device by each
    module's ``reset_parameters()`` (FSDP1's default without ``param_init_fn``). An implementation that leaves
    meta modules to the user after sharding (:attr:`META_INIT`) lacks it."""
    PARAM_INIT_FUNCTION = "param_init_function"
    """``WrapSpec.param_init_fn``: ``wrap`` calls this function on each module of a meta-device model it
    manages, which materializes and initializes it (FSDP1's ``param_init_fn``)."""
    DEVICE_ID = "device_id"
    """Deprecated (protocol 1): :attr:`COMPUTE_DEVICE` and :attr:`PLACEMENT_MESSAGES` together."""
    COMPUTE_DEVICE = "compute_device"
    """Accepts ``WrapSpec.device_id``: computes there and moves the managed parameters there (a
    ``device_id`` without an index: the current device). Nothing about warnings: those are
    :attr:`PLACEMENT_MESSAGES`."""
    PLACEMENT_MESSAGES = "placement_messages"
    """Reports misplaced modules and inputs with FSDP1's exact warnings and errors
    (a CPU module without ``device_id``, a module on another device, a multi-device module)."""
    DEVICE_MESH = "device_mesh"
    """Accepts ``WrapSpec.device_mesh`` (a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid)."""
    WORLD_SIZE_1_SWITCH = "world_size_1_no_shard_switch"
    """At world size 1 a sharded strategy (explicit or the default) warns, with a ``UserWarning`` starting
    :data:`NO_SHARD_SWITCH`, that it runs ``NO_SHARD`` instead (as torch's FSDP1)."""
    CONTAINER_WARNING = "container_warning"
    HOMOGENEOUS_ATTRIBUTES = "homogeneous_attributes"
    UNSAFE_SETATTR = "unsafe_setattr"
    OPTIM_IN_BACKWARD_CHECK = "optim_in_backward_check"
    FORWARD_PREFETCH = "forward_prefetch"
    """``WrapSpec.forward_prefetch``: the next unit's all-gather is issued before this unit's forward
    computation ends. ``forward_prefetch=True`` alone is a performance hint an adapter without this
    capability may ignore; a case that measures what it promises requires the capability."""
    BACKWARD_PREFETCH = "backward_prefetch"
    """``WrapSpec.backward_prefetch`` other than the default ``BACKWARD_PRE`` (``BACKWARD_POST``, or
    ``None``: no prefetch) is honoured."""
    POST_OPTIM_EVENT = "post_optim_event"
    NO_SYNC = "no_sync"
    """Accumulates gradients without communication (FSDP1's ``no_sync()``); the adapter defines
    ``no_sync(model)`` (:func:`conformance.contract.optional.no_sync`)."""
    FULL_STATE_DICT = "full_state_dict"
    """Saves and loads full (unflattened, unpadded) model state dicts."""
    SHARDED_STATE_DICT = "sharded_state_dict"
    """Saves and loads each rank's shards as a model state dict."""
    OPTIM_STATE_DICT = "optim_state_dict"
    """Saves and loads optimizer state dicts keyed by original parameter names, in each
    model state-dict kind the adapter declares."""
    MIXED_PRECISION = "mixed_precision"
    """Computes in ``MixedPrecisionSpec.param_dtype`` (all-gathers in it) and reduces gradients in
    ``reduce_dtype``; the sharded parameters and their gradients stay in full precision. Nothing about
    the model's inputs: a case that feeds floating inputs in another dtype and relies on the
    implementation casting them requires :attr:`MP_CAST_FORWARD_INPUTS` as well."""
    MP_CAST_FORWARD_INPUTS = "mp_cast_forward_inputs"
    """``MixedPrecisionSpec.cast_forward_inputs``: the root module casts the floating-point tensors of
    its forward inputs to ``param_dtype`` before its forward runs (torch FSDP1's
    ``MixedPrecision.cast_root_forward_inputs``, FSDP2's ``MixedPrecisionPolicy.cast_forward_inputs``),
    so a float32 batch computes in the param dtype as if the caller had cast it."""
    MP_KEEP_LOW_PRECISION_GRADS = "mp_keep_low_precision_grads"
    """``MixedPrecisionSpec.keep_low_precision_grads``: gradients are handed to the optimizer in the
    parameter dtype (torch's FSDP2 has no such option)."""
    MP_BUFFER_DTYPE = "mp_buffer_dtype"
    """``MixedPrecisionSpec.buffer_dtype``: buffers are cast for compute (FSDP2 leaves buffers alone)."""
    MP_FULL_PRECISION_IN_EVAL = "mp_full_precision_in_eval"
    """With ``FSDP_USE_FULL_PREC_IN_EVAL=1`` at wrap time, a unit in eval mode gathers and computes in
    full precision despite its mixed-precision policy (an FSDP1 setting)."""
    FULLY_SHARD = "fully_shard"
    """Shards per module in FSDP2's shape: the adapter defines ``fully_shard(module, *, mesh,
    reshard_after_forward, ignored_params)`` (:func:`conformance.contract.optional.fully_shard`), which
    cases call bottom-up, the root last. Afterwards the module's parameters (and ``state_dict()``
    values) are DTensors sharded on dim 0 over ``mesh``; ``reshard_after_forward`` is a bool. As torch's
    ``fully_shard``, each call groups the module's own parameters (those no nested call took) into one
    all-gather per unshard, which ``reshard/*`` reads to tell units apart."""
    FULLY_SHARD_MIXED_PRECISION = "fully_shard_mixed_precision"
    """``fully_shard(..., mixed_precision=spec)`` takes a :class:`MixedPrecisionSpec` of ``param_dtype``,
    ``reduce_dtype`` and ``cast_forward_inputs`` (FSDP2's ``MixedPrecisionPolicy``; ``buffer_dtype`` and
    ``keep_low_precision_grads`` are FSDP1's and are never given): the module computes in ``param_dtype``,
    reduces in ``reduce_dtype`` (``None``: ``param_dtype``) and, with gradient sync off, accumulates in
    ``reduce_dtype`` as torch documents; gradients reach the optimizer in the parameters' dtype."""
    RESHARD_AFTER_FORWARD_INT = "reshard_after_forward_int"
    """``fully_shard(..., reshard_after_forward=k)`` with ``k`` a factor of the mesh size: after forward
    each rank keeps its share for an all-gather over ``k`` ranks in backward."""
    EXPLICIT_PREFETCH = "explicit_prefetch"
    """All-gathers the modules a case lists for a ``fully_shard``-ed module, in that order, right after
    its own in forward or backward: the adapter defines ``set_modules_to_prefetch(module, *, forward,
    backward)`` (:func:`conformance.contract.optional.set_modules_to_prefetch`)."""
    FULLY_SHARD_CONTROLS = "fully_shard_controls"
    """A ``fully_shard``-ed module's own controls (FSDP2's ``FSDPModule`` methods): the adapter defines
    ``unshard(module, *, async_op)``, ``reshard(module)``, ``set_requires_gradient_sync(module, on)`` and
    ``set_reshard_after_backward(module, on)`` (:func:`conformance.contract.optional.unshard` and after). None
    changes a value a user reads: forwards, parameters and, once reduced, gradients stay data-parallel training's."""
    SET_RESHARD_AFTER_FORWARD = "set_reshard_after_forward"
    """``set_reshard_after_forward(module, on, *, recurse)`` (FSDP2's ``FSDPModule`` method): whether the module
    (``recurse``: and those under it) frees its unsharded parameters after forward; no value a user reads changes."""
    GRADIENT_DIVIDE_FACTOR = "gradient_divide_factor"
    """``set_gradient_divide_factor(module, factor)`` (FSDP2's ``FSDPModule`` method, the module's own
    parameters only): their reduction divides the sum over ranks by ``factor`` instead of the world size."""
    REDUCE_SCATTER_DIVIDE_FACTOR = "reduce_scatter_divide_factor"
    """``set_reduce_scatter_divide_factor(module, factor)`` (FSDP2's deprecated alias): as
    ``set_gradient_divide_factor`` (:attr:`GRADIENT_DIVIDE_FACTOR`); a ``DeprecationWarning`` is allowed."""
    ALL_REDUCE_CONTROLS = "all_reduce_controls"
    """On a 2-D (replicate, shard) mesh: ``set_requires_all_reduce(module, on)`` (off, backward reduce-scatters but
    does not all-reduce over the replicas; the next backward that does covers what was kept) and
    ``set_all_reduce_hook(module, hook)`` (``hook`` runs on the all-reduced gradient, in place, before it reaches
    the optimizer); FSDP2's ``FSDPModule`` methods of the same names."""
    RESET_ITER_STATE = "reset_iter_state"
    """``reset_iter_state(module)`` on the root (FSDP2's ``FSDPModule`` method): after an exception raised mid
    forward or backward, the next iteration trains as a fresh one."""
    META_INIT = "meta_init"
    """``fully_shard`` accepts a module built on the meta device; ``to_empty(device=...)`` then gives
    every parameter local storage that user code fills (a ``reset_parameters``), and training reads it."""
    DCP_RESHARD = "dcp_reshard"
    """A model the adapter sharded (``fully_shard`` where it declares :attr:`FULLY_SHARD`, else ``wrap``) and
    its optimizer, through ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict``/``set_state_dict``,
    save with DCP on one number of ranks and load on another."""
    OPTIM_STATE_DICT_ON_THREADS = "optim_state_dict_on_threads"
    """Deprecated, ignored: a declared :attr:`OPTIM_STATE_DICT` holds on thread ranks unless ``thread_rank_limits``
    says otherwise."""
    FULL_STATE_DICT_LOAD_ON_THREADS = "full_state_dict_load_on_threads"
    """Deprecated, ignored: a declared :attr:`FULL_STATE_DICT` loads on thread ranks unless ``thread_rank_limits``
    says otherwise."""
    OPTIM_STATE_DICT_FUNCTIONS = "optim_state_dict_functions"
    """FSDP1's optimizer state-dict functions beside ``optim_state_dict``: the adapter defines
    ``full_optim_state_dict``, ``sharded_optim_state_dict``, ``shard_full_optim_state_dict``,
    ``scatter_full_optim_state_dict``, ``flatten_sharded_optim_state_dict`` and ``rekey_optim_state_dict``
    (:func:`conformance.contract.optional.full_optim_state_dict` and after), each as torch documents it."""
    STATE_DICT_SETTINGS = "state_dict_settings"
    """FSDP1's ``set_state_dict_type`` / ``get_state_dict_type`` with their options
    (:class:`StateDictSettingsSpec`): the adapter defines ``set_state_dict_type(model, settings)``,
    ``get_state_dict_type(model)``, ``optim_state_dict_as_set(model, optim)`` and
    ``load_optim_state_dict_as_set(model, optim, osd)``; afterwards the model's own
    ``state_dict()`` and the optimizer state dict take the type and options set."""
    WRAPPER_METHODS = "wrapper_methods"
    """FSDP1's methods on a wrapped model: the adapter defines ``clip_grad_norm``, ``apply_with_full_params``,
    ``check_is_root``, ``fsdp_modules``, ``named_buffers`` and ``register_comm_hook``
    (:mod:`conformance.contract.wrapper_methods`), each as torch documents FSDP1's method."""
    IGNORED_STATES = "ignored_states"
    """``WrapSpec.ignored_states`` (FSDP1's ``ignored_states``: parameters, or modules): they stay whole and
    unreduced, each rank keeping its own gradient, as ``ignored_modules``'."""
    MP_CAST_UNIT_FORWARD_INPUTS = "mp_cast_unit_forward_inputs"
    """``MixedPrecisionSpec.cast_unit_forward_inputs`` is honoured (FSDP1's ``MixedPrecision.cast_forward_inputs``):
    True, every unit casts the floating tensors of its forward inputs to ``param_dtype``; False, a nested unit
    leaves them as its caller gave them."""
    THREAD_RANKS = "thread_ranks"
    """Runs under the harness's threaded process group (one process, N threads); every case needs it on thread
    ranks (:meth:`CaseSpec.required`): without it those rows are ``n/a``, not failures saying nothing of FSDP."""
    def __str__(self) -> str:
        return self.value


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
    ``cast_unit_forward_inputs``: every unit casts them too, not only the root (FSDP1's
    ``cast_forward_inputs``; :attr:`Capability.MP_CAST_UNIT_FORWARD_INPUTS`); ``False`` relies on no such cast.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = True
    cast_unit_forward_inputs: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
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
