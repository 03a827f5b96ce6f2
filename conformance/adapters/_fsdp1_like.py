"""Shared adapter logic for implementations with ``FullyShardedDataParallel``'s API.

The reference (:mod:`fsdp_impl`) mirrors torch's FSDP1 constructor, context
managers and state-dict entry points, so both adapters differ only in where the
API lives and how a unit's flat parameter is introspected.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn as nn

from conformance.contract.adapter import STRATEGIES, Capability, UnitInfo, WrapSpec
from conformance.contract.state_dict_api import StateDictSettingsSpec

__all__ = ["FSDP1LikeAdapter", "clean_fqn"]

_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def clean_fqn(name: str) -> str:
    """A parameter name as the unwrapped module would spell it."""
    return _WRAPPER_PREFIXES.sub("", name)


class FSDP1LikeAdapter:
    """Adapter for an FSDP whose API mirrors ``torch.distributed.fsdp`` (FSDP1).

    Subclasses set :attr:`name`, :attr:`capabilities` and implement
    :meth:`_api` (the ``torch.distributed.fsdp``-like module), :meth:`_wrap_api`
    (its ``wrap`` module) and :meth:`_unit_info`.
    """

    name = "fsdp1-like"
    capabilities: frozenset[Capability] = frozenset()
    protocol_version = 3

    # -- subclass hooks ---------------------------------------------------
    def _api(self) -> ModuleType:
        raise NotImplementedError

    def _wrap_api(self) -> ModuleType:
        raise NotImplementedError

    def _unit_info(self, fqn: str, unit: nn.Module) -> UnitInfo:
        raise NotImplementedError

    def _default_device_id(self) -> torch.device | None:
        """The device_id used when a spec gives none (``None``: pass nothing)."""
        return None

    # -- protocol -----------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        try:
            self._api()
        except Exception as exc:  # noqa: BLE001 - any import failure makes the adapter unusable
            return f"{type(exc).__name__}: {exc}"
        return None

    def supports_strategy(self, strategy: str | None) -> bool:
        return strategy is None or strategy in STRATEGIES

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        api = self._api()
        return api.FullyShardedDataParallel(module, **self._wrap_kwargs(spec, module))

    def _wrap_kwargs(self, spec: WrapSpec, module: nn.Module) -> dict[str, Any]:
        api = self._api()
        kwargs: dict[str, Any] = {
            "use_orig_params": spec.use_orig_params,
            "sync_module_states": spec.sync_module_states,
            "forward_prefetch": spec.forward_prefetch,
            "limit_all_gathers": spec.limit_all_gathers,
            "backward_prefetch": (
                None if spec.backward_prefetch is None else api.BackwardPrefetch[spec.backward_prefetch]
            ),
        }
        if spec.strategy is not None:
            kwargs["sharding_strategy"] = api.ShardingStrategy[spec.strategy]
        if spec.auto_wrap is not None:
            kwargs["auto_wrap_policy"] = self._policy(spec, module)
        if spec.process_group is not None:
            kwargs["process_group"] = spec.process_group
        if spec.device_mesh is not None:
            kwargs["device_mesh"] = spec.device_mesh
        device_id = spec.device_id if spec.device_id is not None else self._default_device_id()
        if device_id is not None:
            kwargs["device_id"] = device_id
        if spec.cpu_offload:
            kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
        if spec.ignored_modules:
            kwargs["ignored_modules"] = list(spec.ignored_modules)
        if spec.ignored_states:
            kwargs["ignored_states"] = list(spec.ignored_states)
        if spec.param_init_fn is not None:
            kwargs["param_init_fn"] = spec.param_init_fn
        if spec.mixed_precision is not None:
            mp = spec.mixed_precision
            kwargs["mixed_precision"] = api.MixedPrecision(
                param_dtype=mp.param_dtype,
                reduce_dtype=mp.reduce_dtype,
                buffer_dtype=mp.buffer_dtype,
                keep_low_precision_grads=mp.keep_low_precision_grads,
                cast_forward_inputs=mp.cast_unit_forward_inputs,
            )
        kwargs.update(spec.extra)
        return kwargs

    def _policy(self, spec: WrapSpec, module: nn.Module) -> Any:
        wrap = self._wrap_api()
        auto = spec.auto_wrap
        assert auto is not None
        if auto.kind == "module_names":
            return functools.partial(_select, frozenset(map(id, auto.units_under(module, spec.ignored_modules))))
        if auto.kind == "always":
            return wrap.always_wrap_policy
        if auto.kind == "transformer":
            return functools.partial(
                wrap.transformer_auto_wrap_policy, transformer_layer_cls=set(auto.module_classes)
            )
        return wrap.ModuleWrapPolicy(set(auto.module_classes))

    def units(self, model: nn.Module) -> list[UnitInfo]:
        fsdp_cls = self._api().FullyShardedDataParallel
        return [
            self._unit_info(clean_fqn(fqn), module)
            for fqn, module in model.named_modules()
            if isinstance(module, fsdp_cls)
        ]

    def wrapped_module(self, model: nn.Module) -> nn.Module:
        """The user's module: a unit's ``module`` attribute (a plain module is its own)."""
        return model.module if isinstance(model, self._api().FullyShardedDataParallel) else model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """FSDP1's ``no_sync()`` on the root unit."""
        return cast(AbstractContextManager[Any], cast(Any, model).no_sync())

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        fsdp_cls = self._api().FullyShardedDataParallel
        with fsdp_cls.summon_full_params(model, writeback=False):
            return {clean_fqn(n): p.detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None] | None:
        """Gradients of the full parameters (``summon_full_params(with_grads=True)``)."""
        fsdp_cls = self._api().FullyShardedDataParallel
        with fsdp_cls.summon_full_params(model, writeback=False, with_grads=True):
            return {
                clean_fqn(n): None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()
            }

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        with self._state_dict_type(model, sharded=False):
            return {clean_fqn(k): v for k, v in model.state_dict().items()}

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        with self._state_dict_type(model, sharded=True):
            return dict(model.state_dict())

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        with self._state_dict_type(model, sharded=sharded):
            model.load_state_dict(state)

    def optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool
    ) -> dict[str, Any]:
        fsdp_cls = self._api().FullyShardedDataParallel
        with self._state_dict_type(model, sharded=sharded):
            return fsdp_cls.optim_state_dict(model, optim)

    def load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state: dict[str, Any],
        *,
        sharded: bool,
    ) -> None:
        fsdp_cls = self._api().FullyShardedDataParallel
        with self._state_dict_type(model, sharded=sharded):
            optim.load_state_dict(fsdp_cls.optim_state_dict_to_load(model, optim, state))

    # -- FSDP1's optimizer state-dict functions (Capability.OPTIM_STATE_DICT_FUNCTIONS) ---------------
    def full_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool, group: Any = None
    ) -> dict[str, Any]:
        fsdp_cls = self._api().FullyShardedDataParallel
        return cast(dict[str, Any], fsdp_cls.full_optim_state_dict(model, optim, rank0_only=rank0_only, group=group))

    def sharded_optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        return cast(dict[str, Any], self._api().FullyShardedDataParallel.sharded_optim_state_dict(model, optim))

    def shard_full_optim_state_dict(
        self, full_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        fsdp_cls = self._api().FullyShardedDataParallel
        return cast(dict[str, Any], fsdp_cls.shard_full_optim_state_dict(full_osd, model, optim=optim))

    def scatter_full_optim_state_dict(
        self, full_osd: dict[str, Any] | None, model: nn.Module, optim: torch.optim.Optimizer, *, group: Any = None
    ) -> dict[str, Any]:
        fsdp_cls = self._api().FullyShardedDataParallel
        return cast(dict[str, Any], fsdp_cls.scatter_full_optim_state_dict(full_osd, model, optim=optim, group=group))

    def flatten_sharded_optim_state_dict(
        self, sharded_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        fsdp_cls = self._api().FullyShardedDataParallel
        return cast(dict[str, Any], fsdp_cls.flatten_sharded_optim_state_dict(sharded_osd, model, optim))

    def rekey_optim_state_dict(
        self, osd: dict[str, Any], key_type: str, model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        api = self._api()
        kind = api.OptimStateKeyType[key_type]
        return cast(dict[str, Any], api.FullyShardedDataParallel.rekey_optim_state_dict(osd, kind, model, optim=optim))

    # -- FSDP1's state-dict settings (Capability.STATE_DICT_SETTINGS) -------------------------------
    def set_state_dict_type(self, model: nn.Module, settings: StateDictSettingsSpec) -> StateDictSettingsSpec | None:
        api = self._api()
        if settings.kind == "FULL_STATE_DICT":
            config = api.FullStateDictConfig(offload_to_cpu=settings.offload_to_cpu, rank0_only=settings.rank0_only)
            optim_config = api.FullOptimStateDictConfig(offload_to_cpu=settings.optim_offload_to_cpu,
                                                        rank0_only=settings.optim_rank0_only)
        else:
            prefix = "Sharded" if settings.kind == "SHARDED_STATE_DICT" else "Local"
            config = getattr(api, f"{prefix}StateDictConfig")(offload_to_cpu=settings.offload_to_cpu)
            optim_config = getattr(api, f"{prefix}OptimStateDictConfig")(offload_to_cpu=settings.optim_offload_to_cpu)
        previous = api.FullyShardedDataParallel.set_state_dict_type(
            model, api.StateDictType[settings.kind], config, optim_config)
        return _settings_spec(previous)

    def get_state_dict_type(self, model: nn.Module) -> StateDictSettingsSpec | None:
        return _settings_spec(self._api().FullyShardedDataParallel.get_state_dict_type(model))

    def optim_state_dict_as_set(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        return cast(dict[str, Any], self._api().FullyShardedDataParallel.optim_state_dict(model, optim))

    def load_optim_state_dict_as_set(self, model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
        optim.load_state_dict(self._api().FullyShardedDataParallel.optim_state_dict_to_load(model, optim, osd))

    # -- FSDP1's methods on a wrapped model (Capability.WRAPPER_METHODS) ---------------------------
    def clip_grad_norm(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        return cast(torch.Tensor, cast(Any, model).clip_grad_norm_(max_norm, norm_type))

    def apply_with_full_params(self, model: nn.Module, fn: Callable[[nn.Module], None]) -> None:
        model.apply(fn)

    def check_is_root(self, unit: nn.Module) -> bool:
        return bool(cast(Any, unit).check_is_root())

    def fsdp_modules(self, model: nn.Module, *, root_only: bool) -> list[nn.Module]:
        return list(self._api().FullyShardedDataParallel.fsdp_modules(model, root_only=root_only))

    def named_buffers(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """What the model's own ``named_buffers()`` yields inside ``summon_full_params``, names as given."""
        with self._api().FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return [(name, buf.detach().clone()) for name, buf in model.named_buffers()]

    def summoned_params(self, model: nn.Module, path: str, *, recurse: bool, rank0_only: bool, offload_to_cpu: bool,
                        with_grads: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None] | None]:
        """What the module at ``path`` yields inside ``summon_full_params`` on it with these options."""
        fsdp_cls = self._api().FullyShardedDataParallel
        module = next((m for fqn, m in model.named_modules() if clean_fqn(fqn) == path), None)  # the unit first
        if module is None:
            raise ValueError(f"summoned_params: no module at path {path!r} of the wrapped model")
        prefix = f"{path}." if path else ""
        with fsdp_cls.summon_full_params(module, recurse=recurse, writeback=False, rank0_only=rank0_only,
                                         offload_to_cpu=offload_to_cpu, with_grads=with_grads):
            named = [(prefix + clean_fqn(n), p) for n, p in module.named_parameters()]
            params = {n: p.detach().clone() for n, p in named}
            grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in named} if with_grads else None
        return params, grads

    def register_comm_hook(self, model: nn.Module, state: object, hook: Callable[..., None]) -> None:
        cast(Any, model).register_comm_hook(state, hook)

    def _state_dict_type(self, model: nn.Module, *, sharded: bool) -> Any:
        api = self._api()
        kind = api.StateDictType.SHARDED_STATE_DICT if sharded else api.StateDictType.FULL_STATE_DICT
        return api.FullyShardedDataParallel.state_dict_type(model, kind)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _settings_spec(settings: Any) -> StateDictSettingsSpec | None:
    """An implementation's ``StateDictSettings`` (``None``: none) in the suite's terms."""
    if settings is None or settings.state_dict_type is None:
        return None
    config, optim_config = settings.state_dict_config, settings.optim_state_dict_config
    return StateDictSettingsSpec(
        kind=settings.state_dict_type.name,
        offload_to_cpu=config.offload_to_cpu,
        rank0_only=getattr(config, "rank0_only", False),
        optim_offload_to_cpu=optim_config.offload_to_cpu,
        optim_rank0_only=getattr(optim_config, "rank0_only", False),
    )


def _select(chosen: frozenset[int], module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, **_: Any) -> bool:
    """An auto-wrap policy (FSDP1's callable form) making units of the modules whose ids are ``chosen``."""
    return recurse or id(module) in chosen
