"""Construction- and validation-time mutants: argument checks, warnings, syncing, wrapping, state dicts."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from conformance.mutants._base import _Mutant, patch_once

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


class NoSyncModuleStates(_Mutant):
    """Accepts ``sync_module_states=True`` but never broadcasts rank 0's states."""

    name = "mutant-no-sync-module-states"
    breaks = "sync_module_states"
    spec_overrides = {"sync_module_states": False}


class NoExecOrderCheck(_Mutant):
    """Never validates the all-gather order across ranks."""

    name = "mutant-no-exec-order-check"
    breaks = "execution-order validation"

    def _patch_globally(self) -> None:
        import fsdp_impl.exec_order as exec_order

        exec_order.checking_enabled = lambda: False


class ChecksEvalForwards(_Mutant):
    """Validates (and records) the all-gather order of eval-mode forwards as if they were training."""

    name = "mutant-checks-eval-forwards"
    breaks = "skipping order checks for eval forwards"

    def _patch_globally(self) -> None:
        from fsdp_impl.exec_order import ExecOrderData

        record = ExecOrderData.record_pre_forward

        def record_always_training(data: Any, unit: Any, is_training: bool) -> None:
            record(data, unit, True)

        patch_once(ExecOrderData, "record_pre_forward", record_always_training)


class Silent(_Mutant):
    """Never warns (container, world-size-1 switch, execution order): user-facing warnings lost."""

    name = "mutant-silent"
    breaks = "user-facing warnings"

    def _patch_globally(self) -> None:
        import types

        import fsdp_impl.exec_order
        import fsdp_impl.fully_sharded_data_parallel
        import fsdp_impl.init

        quiet = types.SimpleNamespace(warn=lambda *args, **kwargs: None)
        for module in (fsdp_impl.exec_order, fsdp_impl.fully_sharded_data_parallel, fsdp_impl.init):
            module.warnings = quiet  # type: ignore[attr-defined]


class LenientHybridGroups(_Mutant):
    """Hybrid without usable groups silently falls back instead of raising (manual wrap, single group)."""

    name = "mutant-lenient-hybrid-groups"
    breaks = "hybrid process-group argument checks"

    def _patch_globally(self) -> None:
        import fsdp_impl.init as init

        strict = init._hybrid_groups

        def lenient(process_group: Any, strategy: Any, mesh: Any, auto_wrapping: bool) -> Any:
            if process_group is None and mesh is None:
                return init._auto_hybrid_groups(init.ranks_per_node())
            if process_group is not None and not isinstance(process_group, tuple):
                return init.Groups(process_group, None)
            return strict(process_group, strategy, mesh, auto_wrapping)

        patch_once(init, "_hybrid_groups", lenient)


class NoHomogeneityCheck(_Mutant):
    """Units that disagree on use_orig_params / limit_all_gathers / full-precision eval are accepted."""

    name = "mutant-no-homogeneity-check"
    breaks = "homogeneous-attribute validation"

    def _patch_globally(self) -> None:
        import fsdp_impl.unit as unit_mod

        unit_mod.HOMOGENEOUS_ATTRS = ()  # type: ignore[assignment]


class UnsafeSetattrIgnored(_Mutant):
    """Ignores FSDP_USE_UNSAFE_SETATTR: always installs views through the module's ``__setattr__``."""

    name = "mutant-unsafe-setattr-ignored"
    breaks = "FSDP_USE_UNSAFE_SETATTR"

    def _patch_globally(self) -> None:
        import fsdp_impl.flat_param as flat_param

        flat_param.unsafe_setattr_enabled = lambda: False


class ShardedLoadIgnored(_Mutant):
    """Accepts a SHARDED model state dict but leaves the parameters as they were."""

    name = "mutant-sharded-load-ignored"
    breaks = "loading sharded model state dicts"

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        if not sharded:
            super().load_state_dict(model, state, sharded=sharded)


class NoOptimInBackwardCheck(_Mutant):
    """Accepts optimizer-in-backward on flat parameters (the optimizer would never see them)."""

    name = "mutant-no-optim-in-backward-check"
    breaks = "rejecting optimizer-in-backward with use_orig_params=False"

    def _patch_globally(self) -> None:
        from fsdp_impl.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

        check = FSDP._check_ready_for_training

        def check_without_optim_in_backward(unit: Any) -> None:
            flat = unit._handle.flat_param if unit._handle is not None else None
            if flat is not None and hasattr(flat, "_in_backward_optimizers"):
                del flat._in_backward_optimizers
            check(unit)

        patch_once(FSDP, "_check_ready_for_training", check_without_optim_in_backward)


class IgnoredModulesManaged(_Mutant):
    """Accepts ``ignored_modules`` but manages (materializes, moves, flattens) them anyway."""

    name = "mutant-ignored-modules-managed"
    breaks = "ignored_modules"

    def _patch_globally(self) -> None:
        import fsdp_impl.init as init

        init.collect_ignored = lambda root, ignored_modules: set()


class AssumesParameters(_Mutant):
    """Reads the module's device from its first parameter, as if every module had one."""

    name = "mutant-assumes-parameters"
    breaks = "wrapping modules without parameters"

    def _patch_globally(self) -> None:
        import fsdp_impl.init as init

        place = init.place_module

        def place_first_param(root: Any, ignored: Any, device: Any, param_init_fn: Any) -> Any:
            next(root.parameters())  # StopIteration for a parameterless module
            return place(root, ignored, device, param_init_fn)

        patch_once(init, "place_module", place_first_param)


class AutoWrapChildrenOnly(_Mutant):
    """Applies the auto-wrap policy to the root's direct children only, never deeper."""

    name = "mutant-auto-wrap-children-only"
    breaks = "auto-wrapping nested submodules"

    def _patch_globally(self) -> None:
        import fsdp_impl.wrap as wrap
        from fsdp_impl.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

        def children_only(module: Any, policy: Any, ignored: Any, make_unit: Any) -> int:
            for name, child in list(module._modules.items()):
                if child is None or child in ignored or isinstance(child, FSDP) or wrap._is_container(child):
                    continue
                if policy(module=child, recurse=False, nonwrapped_numel=wrap._numel(child, ignored)):
                    module._modules[name] = make_unit(child)
            return 0

        wrap._wrap_children = children_only
