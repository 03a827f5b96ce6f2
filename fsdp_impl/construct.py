"""A unit's construction, step by step: from the constructor's arguments to its :class:`UnitState`.

Order (each decision in :mod:`fsdp_impl.init` or :mod:`fsdp_impl.wrap`): validate
arguments, resolve groups and the effective strategy, auto-wrap children
(sharing the resolved groups), place/materialize this unit's own tensors,
optionally sync them from rank 0, then flatten them into one
:class:`~fsdp_impl.flat_param.FlatParamHandle`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn as nn

from fsdp_impl import init, wrap
from fsdp_impl.api import RESHARD_AFTER_FORWARD, BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_impl.flat_param import FLAT_PARAM_NAME, FlatParamHandle
from fsdp_impl.unit_state import UnitConfig, UnitControls, UnitGroups, UnitState

__all__ = ["UnitArgs", "build_unit", "check_type"]


def check_type(name: str, value: Any, expected: type | tuple[type, ...], allow_none: bool = True) -> None:
    """TypeError naming ``name``, what it must be and what it got, unless ``value`` fits."""
    if value is None and allow_none:
        return
    if not isinstance(value, expected):
        names = expected.__name__ if isinstance(expected, type) else " or ".join(t.__name__ for t in expected)
        raise TypeError(f"{name} must be {names}{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class UnitArgs:
    """The constructor's arguments other than the module, as the user gave them."""

    process_group: Any = None
    sharding_strategy: ShardingStrategy | None = None
    cpu_offload: CPUOffload | None = None
    auto_wrap_policy: Callable[..., bool] | wrap.ModuleWrapPolicy | None = None
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    device_id: int | torch.device | None = None
    sync_module_states: bool = False
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    ignored_modules: Iterable[nn.Module] | None = None
    ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    device_mesh: Any = None
    mixed_precision: MixedPrecision | None = None

    def for_children(
        self, groups: init.Groups, strategy: ShardingStrategy, ignored: set[nn.Module],
        params: Sequence[nn.Parameter] = (),
    ) -> UnitArgs:
        """What auto-wrapped children are built with: this unit's resolved groups and strategy, and what it
        ignores (modules, or parameters: torch takes one of the two)."""
        return replace(
            self,
            process_group=groups.as_arg(),
            sharding_strategy=strategy,
            auto_wrap_policy=None,
            ignored_modules=None if params else list(ignored),
            ignored_states=list(params) or None,
            device_mesh=None,
        )

    def as_kwargs(self) -> dict[str, Any]:
        """The arguments as constructor keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def build_unit(
    module: nn.Module, args: UnitArgs, make_unit: Callable[[nn.Module, UnitArgs], nn.Module]
) -> UnitState:
    """Run the construction steps for ``module``; ``make_unit`` builds auto-wrapped children."""
    check_type("module", module, nn.Module, allow_none=False)
    check_type("sharding_strategy", args.sharding_strategy, ShardingStrategy)
    check_type("cpu_offload", args.cpu_offload, CPUOffload)
    check_type("backward_prefetch", args.backward_prefetch, BackwardPrefetch)
    check_type("mixed_precision", args.mixed_precision, MixedPrecision)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        warnings.warn(
            f"FSDP will not all-gather parameters for containers that do not implement forward: {module}",
            stacklevel=3,
        )
    ignored_modules, ignored_params = _split_ignored(args.ignored_modules, args.ignored_states)
    ignored = init.collect_ignored(module, ignored_modules)
    device = init.resolve_device_id(args.device_id)
    auto_wrapping = args.auto_wrap_policy is not None
    if args.auto_wrap_policy is not None:
        wrap.check_policy(args.auto_wrap_policy)
    strategy_asked = args.sharding_strategy or ShardingStrategy.FULL_SHARD
    groups = init.resolve_groups(args.process_group, strategy_asked, args.device_mesh, auto_wrapping)
    strategy = init.effective_strategy(args.sharding_strategy, groups)
    if args.auto_wrap_policy is not None:
        children = args.for_children(groups, strategy, ignored, ignored_params)
        wrap.auto_wrap(module, args.auto_wrap_policy, ignored, lambda child: make_unit(child, children))
    compute_device = init.place_module(module, ignored, device, args.param_init_fn, ignored_params)
    params, buffers = init.managed_tensors(module, ignored, ignored_params)
    init.check_not_shared_with_nested(module, params)
    if args.sync_module_states:
        init.sync_module_states(params, buffers, groups, compute_device)
    config = _config(args, strategy)
    unit_groups = init.unit_groups(groups, strategy)
    handle = _build_handle(module, params, compute_device, config, unit_groups)
    controls = UnitControls(reshard_after_forward=None if strategy in RESHARD_AFTER_FORWARD else False)
    return UnitState(module, config, unit_groups, compute_device, handle, controls)


def _split_ignored(
    modules: Iterable[nn.Module] | None, states: Iterable[nn.Parameter] | Iterable[nn.Module] | None
) -> tuple[list[nn.Module] | None, list[nn.Parameter]]:
    """``ignored_modules`` and ``ignored_states`` (all parameters, or all modules) as ignored modules and
    ignored parameters; torch refuses both arguments at once, and a mix of the two kinds."""
    if modules is not None and states is not None:
        raise ValueError("Cannot pass both ignored_modules and ignored_states at the same time. "
                         "Please just pass ignored_states.")
    given: list[Any] = list(states or [])
    if all(isinstance(state, nn.Parameter) for state in given):
        return (None if modules is None else list(modules)), given
    if all(isinstance(state, nn.Module) for state in given):
        return given, []
    kinds = sorted({type(state).__name__ for state in given})
    raise ValueError(f"ignored_states expects all nn.Parameter or all nn.Module list elements but got types {kinds}")


def _config(args: UnitArgs, strategy: ShardingStrategy) -> UnitConfig:
    return UnitConfig(
        sharding_strategy=strategy,
        cpu_offload=args.cpu_offload or CPUOffload(),
        backward_prefetch=args.backward_prefetch,
        forward_prefetch=bool(args.forward_prefetch),
        limit_all_gathers=bool(args.limit_all_gathers),
        use_orig_params=bool(args.use_orig_params),
        use_full_prec_in_eval=os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1",
        mixed_precision=args.mixed_precision,
    )


def _build_handle(
    module: nn.Module,
    params: list[tuple[str, nn.Module, str, nn.Parameter]],
    compute_device: torch.device,
    config: UnitConfig,
    groups: UnitGroups,
) -> FlatParamHandle | None:
    """Flatten this unit's own parameters (None when it has none)."""
    if not params:
        return None
    handle = FlatParamHandle(
        params,
        compute_device=compute_device,
        offload_params=config.cpu_offload.offload_params,
        shard_group=groups.shard_group,
        shard_size=groups.shard_size,
        shard_rank=groups.shard_rank,
        use_orig_params=config.use_orig_params,
        mixed_precision=config.mixed_precision,
    )
    if not config.use_orig_params:
        module.register_parameter(FLAT_PARAM_NAME, handle.flat_param)
    return handle
