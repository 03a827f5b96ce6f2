"""``FullyShardedDataParallel``: the unit module, its constructor and public entry points.

Construction order (each step in :mod:`fsdp_impl.init` or :mod:`fsdp_impl.wrap`):
validate arguments, resolve groups and the effective strategy, auto-wrap
children (sharing the resolved groups), place/materialize this unit's own
tensors, optionally sync them from rank 0, then flatten them into one
:class:`~fsdp_impl.flat_param.FlatParamHandle`. Runtime behaviour lives in
:mod:`fsdp_impl.unit` (see [Note: unit lifecycle] there).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import collectives, init, unit, wrap
from fsdp_impl.api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    ShardingStrategy,
    StateDictType,
    TrainingState,
)
from fsdp_impl.flat_param import FLAT_PARAM_NAME, FlatParamHandle

__all__ = ["FullyShardedDataParallel", "FSDP_WRAPPED_MODULE"]

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"


def _check_type(
    name: str, value: Any, expected: type | tuple[type, ...], allow_none: bool = True
) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, expected):
        names = (
            expected.__name__
            if isinstance(expected, type)
            else " or ".join(t.__name__ for t in expected)
        )
        raise TypeError(f"{name} must be {names}{' or None' if allow_none else ''}, got {value!r}")


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
    ) -> None:
        super().__init__()
        _check_type("module", module, nn.Module, allow_none=False)
        _check_type("sharding_strategy", sharding_strategy, ShardingStrategy)
        _check_type("cpu_offload", cpu_offload, CPUOffload)
        _check_type("backward_prefetch", backward_prefetch, BackwardPrefetch)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            warnings.warn(
                "FSDP will not all-gather parameters for containers that do not "
                f"implement forward: {module}",
                stacklevel=2,
            )
        ignored = init.collect_ignored(module, ignored_modules)
        device = init.resolve_device_id(device_id)
        if auto_wrap_policy is not None:
            wrap.check_policy(auto_wrap_policy)
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        groups = init.resolve_groups(
            process_group, strategy, device_mesh, auto_wrap_policy is not None
        )
        self.sharding_strategy = init.effective_strategy(sharding_strategy, groups)
        self.cpu_offload = cpu_offload or CPUOffload()
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = bool(forward_prefetch)
        self.limit_all_gathers = bool(limit_all_gathers)
        self._use_orig_params = bool(use_orig_params)
        self._use_full_prec_in_eval = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1"
        self._set_groups(groups)
        if auto_wrap_policy is not None:
            child_kwargs = dict(
                process_group=groups.as_arg(),
                sharding_strategy=self.sharding_strategy,
                cpu_offload=cpu_offload,
                backward_prefetch=backward_prefetch,
                device_id=device_id,
                sync_module_states=sync_module_states,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                use_orig_params=use_orig_params,
                ignored_modules=list(ignored),
                param_init_fn=param_init_fn,
            )
            wrap.auto_wrap(
                module, auto_wrap_policy, ignored, lambda m: type(self)(m, **child_kwargs)
            )
        self._fsdp_wrapped_module = module
        self.compute_device = init.place_module(module, ignored, device, param_init_fn)
        params, buffers = init.managed_tensors(module, ignored)
        self._check_not_shared_with_nested(params)
        if sync_module_states:
            init.sync_module_states(params, buffers, groups, self.compute_device)
        self._handle = self._build_handle(params)
        self._is_root: bool | None = None
        self._root_state: unit.RootState | None = None
        self._fqn_prefix = ""
        self._ran_pre_backward = False
        self._backward_task = -1
        self.training_state = TrainingState.IDLE
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._saved_flat_grad: torch.Tensor | None = None

    # -- construction helpers ---------------------------------------------------------------
    def _set_groups(self, groups: init.Groups) -> None:
        hybrid = self.sharding_strategy in HYBRID_STRATEGIES
        self.process_group = groups.shard
        self._inter_node_pg = groups.replicate if hybrid else None
        if self.sharding_strategy is ShardingStrategy.NO_SHARD:
            # NO_SHARD = a shard group of one and the whole group as replicate group.
            self._shard_group: dist.ProcessGroup | None = None
            self._replicate_group = groups.shard
            self._shard_size, self._shard_rank = 1, 0
        else:
            self._shard_group = groups.shard
            self._replicate_group = groups.replicate
            self._shard_size = collectives.group_size(groups.shard)
            self._shard_rank = collectives.group_rank(groups.shard)
        self._dp_world_size = self._shard_size * unit.replicate_world(self._replicate_group)

    def _check_not_shared_with_nested(
        self, params: list[tuple[str, nn.Module, str, nn.Parameter]]
    ) -> None:
        nested: dict[int, str] = {}
        for fqn, sub in self._fsdp_wrapped_module.named_modules():
            if isinstance(sub, FullyShardedDataParallel) and sub._handle is not None:
                nested.update({id(slot.param): f"{fqn}.{slot.fqn}" for slot in sub._handle.slots})
        for fqn, _, _, param in params:
            if id(param) in nested:
                raise ValueError(
                    f"parameter {fqn!r} is shared with nested unit parameter "
                    f"{nested[id(param)]!r}; "
                    "shared parameters must belong to one unit (wrap their common ancestor instead)"
                )

    def _build_handle(
        self, params: list[tuple[str, nn.Module, str, nn.Parameter]]
    ) -> FlatParamHandle | None:
        if not params:
            return None
        handle = FlatParamHandle(
            params,
            compute_device=self.compute_device,
            offload_params=self.cpu_offload.offload_params,
            shard_group=self._shard_group,
            shard_size=self._shard_size,
            shard_rank=self._shard_rank,
            use_orig_params=self._use_orig_params,
        )
        if not self._use_orig_params:
            self._fsdp_wrapped_module.register_parameter(FLAT_PARAM_NAME, handle.flat_param)
        return handle

    def _check_ready_for_training(self) -> None:
        """Lazy-init checks that need the final model (after the user may have moved it)."""
        handle = self._handle
        if handle is None:
            return
        if not self._use_orig_params and hasattr(handle.flat_param, "_in_backward_optimizers"):
            raise RuntimeError(
                "FSDP optimizer in backward only supported with use_orig_params=True!"
            )
        device = handle.flat_param.device
        if handle.offload_params and device.type != "cpu":
            raise RuntimeError(
                "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
                f"{device}. Make sure to not move the module from CPU when offloading parameters."
            )
        if not handle.offload_params and device != self.compute_device:
            raise RuntimeError(
                f"An FSDP-managed module unexpectedly has parameters on {device}. "
                f"Make sure to move "
                f"the module to {self.compute_device} before training."
            )

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
        from fsdp_impl import state_dict

        if prefix or destination is not None or args:
            return super().state_dict(
                *args, destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        return state_dict.model_state_dict(self, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load the output of :meth:`state_dict` for the current ``state_dict_type``."""
        from fsdp_impl import state_dict as sd

        return sd.load_model_state_dict(self, state_dict, strict=strict)

    # -- introspection (see README: "Introspection") ------------------------------------------
    @property
    def flat_param(self) -> nn.Parameter | None:
        """This unit's flat parameter; its data is the local shard when resharded."""
        return None if self._handle is None else self._handle.flat_param

    @property
    def is_resharded(self) -> bool:
        """True when the unsharded storage is freed and only the local shard is held."""
        return self._handle is None or self._handle.is_resharded

    @property
    def shard_info(self) -> dict[str, int]:
        """Flat sizes: ``numel``, ``padded_numel``, ``shard_numel``; ``shard_size``/``_rank``."""
        h = self._handle
        if h is None:
            return {
                "numel": 0,
                "padded_numel": 0,
                "shard_numel": 0,
                "shard_size": self._shard_size,
                "shard_rank": self._shard_rank,
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
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        inner = {
            id(m)
            for u in units
            for m in u.modules()
            if m is not u and isinstance(m, FullyShardedDataParallel)
        }
        return [u for u in units if id(u) not in inner]

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Expose full parameters inside the context (see :mod:`fsdp_impl.state_dict`)."""
        from fsdp_impl import state_dict

        unsupported = {
            "recurse": not recurse,
            "rank0_only": rank0_only,
            "offload_to_cpu": offload_to_cpu,
        }
        if any(unsupported.values()):
            raise NotImplementedError(
                f"summon_full_params supports only recurse=True, rank0_only=False, "
                f"offload_to_cpu=False; got recurse={recurse}, rank0_only={rank0_only}, "
                f"offload_to_cpu={offload_to_cpu}"
            )
        return state_dict.summon_full_params(module, writeback=writeback, with_grads=with_grads)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module, state_dict_type: StateDictType
    ) -> Generator[None, None, None]:
        """Make ``state_dict()`` / ``load_state_dict()`` use ``state_dict_type`` inside."""
        _check_type("state_dict_type", state_dict_type, StateDictType, allow_none=False)
        units = FullyShardedDataParallel.fsdp_modules(module)
        previous = [u._state_dict_type for u in units]
        for u in units:
            u._state_dict_type = state_dict_type
        try:
            yield
        finally:
            for u, kind in zip(units, previous, strict=True):
                u._state_dict_type = kind

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by original parameter FQN (see :mod:`fsdp_impl.state_dict`)."""
        from fsdp_impl import state_dict

        return state_dict.optim_state_dict(model, optim)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """Convert :meth:`optim_state_dict` output back to what ``optim.load_state_dict`` takes."""
        from fsdp_impl import state_dict

        return state_dict.optim_state_dict_to_load(model, optim, optim_state_dict)
