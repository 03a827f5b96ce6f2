"""``FullyShardedDataParallel``: the public unit module, a thin top floor over the unit state.

The constructor hands its arguments to :func:`fsdp_impl.construct.build_unit`
and keeps the returned :class:`~fsdp_impl.unit_state.UnitState`; ``forward``
runs :mod:`fsdp_impl.unit` (see [Note: unit lifecycle] there), state dicts run
:mod:`fsdp_impl.state_dict`. Everything below this module reaches a unit through
its state (see [Note: unit state]); nothing below imports this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import construct, no_sync, summon, unit, unit_methods, wrap
from fsdp_impl import optim_state_api as osa
from fsdp_impl import state_dict as sd
from fsdp_impl import state_dict_settings as settings
from fsdp_impl.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    TrainingState,
)
from fsdp_impl.unit_state import STATE_ATTR, UnitState, unit_state, unit_states

__all__ = ["FullyShardedDataParallel", "FSDP_WRAPPED_MODULE"]

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters across ranks; see the package README for semantics."""

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., bool] | wrap.ModuleWrapPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_mesh: Any = None,
        mixed_precision: MixedPrecision | None = None,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        args = construct.UnitArgs(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            ignored_modules=ignored_modules,
            ignored_states=ignored_states,
            param_init_fn=param_init_fn,
            device_mesh=device_mesh,
            mixed_precision=mixed_precision,
        )
        state = construct.build_unit(module, args, lambda child, kw: type(self)(child, **kw.as_kwargs()))
        self._fsdp_wrapped_module = module
        setattr(self, STATE_ATTR, state)

    @property
    def _state(self) -> UnitState:
        state = unit_state(self)
        assert state is not None, "FullyShardedDataParallel used before its constructor finished"
        return state

    # -- nn.Module surface -------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module, as torch's FSDP does."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return unit.run_forward(self, args, kwargs)

    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """Root call: the layout chosen by ``state_dict_type``; nested calls: plain recursion."""
        if prefix or destination is not None or args:
            return super().state_dict(
                *args, destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        return sd.model_state_dict(self)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load the output of :meth:`state_dict` for the current ``state_dict_type``."""
        return sd.load_model_state_dict(self, state_dict, strict=strict)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Inside, backwards accumulate unsharded gradients locally and communicate nothing; the
        first backward after it reduces them with its own (root only; see [Note: no_sync])."""
        return no_sync.no_sync(self)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with every unit's full parameters summoned, what ``fn`` writes kept."""
        if self._state.training_state is TrainingState.SUMMON_FULL_PARAMS:  # a unit under the one applying
            return super().apply(fn)
        with summon.summon_full_params(self, writeback=True):
            return super().apply(fn)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``, named as the wrapped module names them inside ``summon_full_params``."""
        clean = self._state.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (name.replace(f"{FSDP_WRAPPED_MODULE}.", "") if clean else name), buffer

    def check_is_root(self) -> bool:
        """Whether this unit is a root (lazy init first: the unit asked before any forward becomes one)."""
        return unit_methods.check_is_root(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter to total norm ``max_norm``, root only (collective)."""
        return unit_methods.clip_grad_norm_(self, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """``hook`` reduces every unit's gradients instead ([Note: comm hook] in ``reduction.py``)."""
        unit_methods.register_comm_hook(self, state, hook)

    # -- introspection (see README: "Introspection") ------------------------------------------
    @property
    def flat_param(self) -> nn.Parameter | None:
        """This unit's flat parameter; its data is the local shard when resharded."""
        handle = self._state.handle
        return None if handle is None else handle.flat_param

    @property
    def is_resharded(self) -> bool:
        """True when the unsharded storage is freed and only the local shard is held."""
        handle = self._state.handle
        return handle is None or handle.is_resharded

    @property
    def compute_device(self) -> torch.device:
        """Where the unsharded parameter lives and compute runs."""
        return self._state.compute_device

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The shard group (for hybrid strategies, the intra-node group)."""
        return self._state.groups.process_group

    @property
    def _inter_node_pg(self) -> dist.ProcessGroup | None:
        """The replicate group of a hybrid unit, else None (torch's attribute name)."""
        return self._state.groups.inter_node_pg

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The effective strategy (NO_SHARD when the data-parallel world is 1)."""
        return self._state.config.sharding_strategy

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._state.config.cpu_offload

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._state.config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._state.config.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._state.config.limit_all_gathers

    @property
    def training_state(self) -> TrainingState:
        """The phase the unit is in."""
        return self._state.training_state

    @property
    def shard_info(self) -> dict[str, int]:
        """Flat sizes: ``numel``, ``padded_numel``, ``shard_numel``; ``shard_size``/``_rank``."""
        h = self._state.handle
        if h is None:
            groups = self._state.groups
            return {
                "numel": 0,
                "padded_numel": 0,
                "shard_numel": 0,
                "shard_size": groups.shard_size,
                "shard_rank": groups.shard_rank,
            }
        return {
            "numel": h.numel,
            "padded_numel": h.padded_numel,
            "shard_numel": h.shard_numel,
            "shard_size": h.shard_size,
            "shard_rank": h.shard_rank,
        }

    # -- public static API -------------------------------------------------------------------
    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every unit in ``module``'s tree (only roots with ``root_only``)."""
        return [m for m in unit_methods.fsdp_modules(module, root_only) if isinstance(m, FullyShardedDataParallel)]

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Expose full parameters inside the context (see :mod:`fsdp_impl.summon`)."""
        return summon.summon_full_params(module, writeback=writeback, with_grads=with_grads, recurse=recurse,
                                         rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator[None, None, None]:
        """Make ``state_dict()`` / ``load_state_dict()`` and the optimizer state dicts use ``state_dict_type``
        with these options inside (see :meth:`set_state_dict_type`); the previous settings after."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            if previous is not None:
                settings.set_settings(unit_states(module), previous)

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings | None:
        """Give every unit in ``module``'s tree this type and these options (``None``: the type's defaults);
        the settings they held before ([Note: state dict settings])."""
        construct.check_type("state_dict_type", state_dict_type, StateDictType, allow_none=False)
        new = settings.settings_for(state_dict_type, state_dict_config, optim_state_dict_config)
        units = unit_states(module)
        previous = settings.settings_of(units)
        settings.set_settings(units, new)
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
        """The settings every unit in ``module``'s tree holds (``None`` without units)."""
        return settings.settings_of(unit_states(module))

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by original parameter FQN (see :mod:`fsdp_impl.state_dict`)."""
        return sd.optim_state_dict(model, optim)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """Convert :meth:`optim_state_dict` output back to what ``optim.load_state_dict`` takes."""
        return sd.optim_state_dict_to_load(model, optim, optim_state_dict)

    # -- FSDP1's older optimizer state dicts ([Note: older optimizer state dicts]) ---------------
    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Full optimizer state keyed by parameter names; empty on ranks but 0 with ``rank0_only``."""
        _refuse_optim_input(optim_input)
        return osa.full_optim_state_dict(model, optim, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """This rank's pieces of the optimizer state, keyed by parameter names."""
        return osa.sharded_optim_state_dict(model, optim)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """A :meth:`full_optim_state_dict` as ``optim.load_state_dict`` takes it on this rank."""
        _refuse_optim_input(optim_input)
        return osa.shard_full_optim_state_dict(full_optim_state_dict, model, optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """A :meth:`sharded_optim_state_dict` as ``optim.load_state_dict`` takes it."""
        return osa.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """Rank 0's :meth:`full_optim_state_dict` (ignored elsewhere) as each rank's ``optim`` loads it."""
        _refuse_optim_input(optim_input)
        return osa.scatter_full_optim_state_dict(full_optim_state_dict, model, optim, group)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` keyed by parameter names or by parameter positions."""
        _refuse_optim_input(optim_input)
        construct.check_type("optim_state_key_type", optim_state_key_type, OptimStateKeyType, allow_none=False)
        return osa.rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, optim)


def _refuse_optim_input(optim_input: Any) -> None:
    """``optim_input`` is deprecated in torch; this reference takes ``optim`` (or ``model.parameters()``)."""
    if optim_input is not None:
        raise NotImplementedError("optim_input is not supported: pass optim instead")
