"""Construction- and validation-time mutants: argument checks, warnings, syncing, wrapping, state dicts."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = [
    "NoSyncModuleStates",
    "NoExecOrderCheck",
    "ChecksEvalForwards",
    "Silent",
    "LenientHybridGroups",
    "NoHomogeneityCheck",
    "UnsafeSetattrIgnored",
    "ShardedLoadIgnored",
    "NoOptimInBackwardCheck",
    "IgnoredModulesManaged",
    "AssumesParameters",
    "AutoWrapChildrenOnly",
]

Fn = Callable[..., Any]


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


class NoSyncModuleStates(_Mutant):
    """Accepts ``sync_module_states=True`` but never broadcasts rank 0's states."""

    name = "mutant-no-sync-module-states"
    breaks = "sync_module_states"
    expect = Expect(
        "same_model_across_ranks or sync_module_states", "thread",
        ("construction/same_model_across_ranks", "placement/cpu_init_with_sync_module_states[on=cpu]",
         "hybrid_shard/sync_module_states"),
    )
    spec_overrides = {"sync_module_states": False}


class NoExecOrderCheck(_Mutant):
    """Never validates the all-gather order across ranks."""

    name = "mutant-no-exec-order-check"
    breaks = "execution-order validation"
    expect = Expect(
        "invalid_first_iter_order or invalid_later_iter_order", "thread",
        ("exec_order/invalid_first_iter_order", "exec_order/invalid_later_iter_order"),
    )
    patches = (Patch.instead("fsdp_impl.exec_order:checking_enabled", _never),)


def _record_always_training(record: Fn) -> Fn:
    def record_as_training(data: Any, unit: Any, is_training: bool) -> None:
        record(data, unit, True)

    return record_as_training


class ChecksEvalForwards(_Mutant):
    """Validates (and records) the all-gather order of eval-mode forwards as if they were training."""

    name = "mutant-checks-eval-forwards"
    breaks = "skipping order checks for eval forwards"
    expect = Expect("train_eval", "thread", ("exec_order/train_eval",))
    patches = (Patch("fsdp_impl.exec_order:ExecOrderData.record_pre_forward", _record_always_training),)


_QUIET = types.SimpleNamespace(warn=lambda *args, **kwargs: None)


class Silent(_Mutant):
    """Never warns (container, world-size-1 switch, execution order): user-facing warnings lost."""

    name = "mutant-silent"
    breaks = "user-facing warnings"
    expect = Expect(
        "unsupported_container_warning or world_size_1_no_shard_warning", "thread",
        ("construction/unsupported_container_warning",
         "construction/world_size_1_no_shard_warning[strategy=FULL_SHARD]",
         "construction/world_size_1_no_shard_warning[strategy=SHARD_GRAD_OP]",
         "construction/world_size_1_no_shard_warning[strategy=None]"),
    )
    patches = tuple(
        Patch.instead(f"fsdp_impl.{module}:warnings", _QUIET)
        for module in ("exec_order", "construct", "init")
    )


def _lenient_hybrid_groups(strict: Fn) -> Fn:
    import fsdp_impl.init as init

    def lenient(process_group: Any, strategy: Any, mesh: Any, auto_wrapping: bool) -> Any:
        if process_group is None and mesh is None:
            return init._auto_hybrid_groups(init.ranks_per_node())
        if process_group is not None and not isinstance(process_group, tuple):
            return init.Groups(process_group, None)
        return strict(process_group, strategy, mesh, auto_wrapping)

    return lenient


class LenientHybridGroups(_Mutant):
    """Hybrid without usable groups silently falls back instead of raising (manual wrap, single group)."""

    name = "mutant-lenient-hybrid-groups"
    breaks = "hybrid process-group argument checks"
    expect = Expect(
        "manual_wrap_requires_pg or invalid_pg_specification", "thread",
        ("hybrid_shard/manual_wrap_requires_pg", "hybrid_shard/invalid_pg_specification"),
    )
    patches = (Patch("fsdp_impl.init:_hybrid_groups", _lenient_hybrid_groups),)


class NoHomogeneityCheck(_Mutant):
    """Units that disagree on use_orig_params / limit_all_gathers / full-precision eval are accepted."""

    name = "mutant-no-homogeneity-check"
    breaks = "homogeneous-attribute validation"
    expect = Expect("homogeneous_attributes", "thread", ("construction/homogeneous_attributes",))
    patches = (Patch.instead("fsdp_impl.unit:HOMOGENEOUS_ATTRS", ()),)


class UnsafeSetattrIgnored(_Mutant):
    """Ignores FSDP_USE_UNSAFE_SETATTR: always installs views through the module's ``__setattr__``."""

    name = "mutant-unsafe-setattr-ignored"
    breaks = "FSDP_USE_UNSAFE_SETATTR"
    expect = Expect("unsafe_setattr", "thread", ("construction/unsafe_setattr[env_value=1]",))
    patches = (Patch.instead("fsdp_impl.flat_param:unsafe_setattr_enabled", _never),)


class ShardedLoadIgnored(_Mutant):
    """Accepts a SHARDED model state dict but leaves the parameters as they were."""

    name = "mutant-sharded-load-ignored"
    breaks = "loading sharded model state dicts"
    #: (The stateful fuzzer's rows reach it at seed 0 with the main job's budget no longer: the programs drawn moved
    #: when ClipGradNorm and ScaleParams joined the operations.)
    expect = Expect("sharded_state_dict_roundtrip", "thread", ("hybrid_shard/sharded_state_dict_roundtrip",))

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        if not sharded:
            super().load_state_dict(model, state, sharded=sharded)


def _check_without_optim_in_backward(check: Fn) -> Fn:
    def check_after_dropping_optimizers(unit: Any) -> None:
        flat = unit.handle.flat_param if unit.handle is not None else None
        if flat is not None and hasattr(flat, "_in_backward_optimizers"):
            del flat._in_backward_optimizers
        check(unit)

    return check_after_dropping_optimizers


class NoOptimInBackwardCheck(_Mutant):
    """Accepts optimizer-in-backward on flat parameters (the optimizer would never see them)."""

    name = "mutant-no-optim-in-backward-check"
    breaks = "rejecting optimizer-in-backward with use_orig_params=False"
    expect = Expect(
        "optim_in_backward_requires_orig_params", "thread", ("construction/optim_in_backward_requires_orig_params",),
    )
    patches = (Patch("fsdp_impl.unit:_check_ready_for_training", _check_without_optim_in_backward),)


def _no_ignored(root: Any, ignored_modules: Any) -> set[nn.Module]:
    return set()


class IgnoredModulesManaged(_Mutant):
    """Accepts ``ignored_modules`` but manages (materializes, moves, flattens) them anyway."""

    name = "mutant-ignored-modules-managed"
    breaks = "ignored_modules"
    expect = Expect(
        "ignored_module_meta or ignored_params_not_moved", "thread",
        ("placement/ignored_module_meta", "placement/ignored_params_not_moved[on=cpu]"),
    )
    patches = (Patch.instead("fsdp_impl.init:collect_ignored", _no_ignored),)


def _place_first_param(place: Fn) -> Fn:
    def place_reading_first_param(root: Any, ignored: Any, device: Any, param_init_fn: Any, *rest: Any) -> Any:
        next(root.parameters())  # StopIteration for a parameterless module
        return place(root, ignored, device, param_init_fn, *rest)

    return place_reading_first_param


class AssumesParameters(_Mutant):
    """Reads the module's device from its first parameter, as if every module had one."""

    name = "mutant-assumes-parameters"
    breaks = "wrapping modules without parameters"
    expect = Expect("no_params", "thread", ("placement/no_params",))
    patches = (Patch("fsdp_impl.init:place_module", _place_first_param),)


def _wrap_children_only(module: Any, policy: Any, ignored: Any, make_unit: Any) -> int:
    import fsdp_impl.wrap as wrap
    from fsdp_impl.unit_state import is_unit

    for name, child in list(module._modules.items()):
        if child is None or child in ignored or is_unit(child) or wrap._is_container(child):
            continue
        if policy(module=child, recurse=False, nonwrapped_numel=wrap._numel(child, ignored)):
            module._modules[name] = make_unit(child)
    return 0


class AutoWrapChildrenOnly(_Mutant):
    """Applies the auto-wrap policy to the root's direct children only, never deeper."""

    name = "mutant-auto-wrap-children-only"
    breaks = "auto-wrapping nested submodules"
    # device_id_auto_wrap's CPU rows cannot see placement, but they do check that every
    # nested layer became a unit (the GPU rows check that device_id reached each one).
    expect = Expect("device_id_auto_wrap and not gpu", "thread", ("placement/device_id_auto_wrap[on=cpu]",))
    patches = (Patch.instead("fsdp_impl.wrap:_wrap_children", _wrap_children_only),)
