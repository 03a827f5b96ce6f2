"""Deliberately broken variants of the reference, to prove that cases can fail.

Each mutant is the reference adapter with exactly one behaviour broken. The
suite's own tests (``conformance/tests/test_mutants.py``) run the matching
cases against each mutant and assert they report FAIL: a case that passes
against a mutant it should catch is not testing what it claims.

Mutants patch ``fsdp_impl`` in the process they run in, so they are only ever
run in a separate pytest session (never next to the real reference). Register
them with ``FSDP_CONFORMANCE_ADAPTERS="name=conformance.mutants:Class,..."``.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from conformance.adapters.base import WrapSpec
from conformance.adapters.reference import ReferenceAdapter

__all__ = ["MUTANTS", "NoGradDivide", "WrongReplicateGroup", "NoReshardAfterBackward",
           "NoSyncModuleStates", "NoExecOrderCheck", "NoRegatherForRecompute",
           "NoPrefetch", "ChecksEvalForwards", "Silent",
           "LenientHybridGroups", "NoHomogeneityCheck",
           "UnsafeSetattrIgnored", "HooksOnPlainTensorOutputsOnly", "ShardedLoadIgnored",
           "NoOptimInBackwardCheck", "ZeroGradForUnused", "FirstGradPieceOnly", "NoNestedBackwardGuard",
           "IgnoredModulesManaged", "AssumesParameters", "DeviceIdIgnored", "DeviceIdNotPropagated",
           "OffloadDroppedWithDeviceId", "MovesCpuModuleSilently", "ConsolidatesDevices",
           "AutoWrapChildrenOnly", "OffloadedGradsDropped"]


class _Mutant(ReferenceAdapter):
    breaks = ""

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        self._patch_globally()
        model = super().wrap(module, self._mutate_spec(spec))
        for unit in self._api().FullyShardedDataParallel.fsdp_modules(model):
            self._mutate_unit(unit)
        return model

    def _patch_globally(self) -> None:
        """Module-level patches (idempotent)."""

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        return spec

    def _mutate_unit(self, unit: Any) -> None:
        """Per-unit breakage."""


class NoGradDivide(_Mutant):
    """Sums gradients across ranks but never divides by the data-parallel world size."""

    name = "mutant-no-grad-divide"
    breaks = "gradient averaging"

    def _mutate_unit(self, unit: Any) -> None:
        unit._dp_world_size = 1


class WrongReplicateGroup(_Mutant):
    """Hybrid units all-reduce over the shard group instead of the replicate group."""

    name = "mutant-wrong-replicate-group"
    breaks = "hybrid replicate all-reduce group"

    def _mutate_unit(self, unit: Any) -> None:
        if unit._inter_node_pg is not None:
            unit._replicate_group = unit._shard_group
            unit._inter_node_pg = unit._shard_group


class NoReshardAfterBackward(_Mutant):
    """The end-of-backward callback leaves units unsharded (e.g. ones whose output was unused)."""

    name = "mutant-no-reshard-after-backward"
    breaks = "resharding at the end of backward"

    def _patch_globally(self) -> None:
        import fsdp_impl.unit as unit_mod

        if getattr(unit_mod, "_mutant_patched", False):  # noqa: B009
            return
        from fsdp_impl.flat_param import FlatParamHandle as handle_cls

        original = unit_mod._final_callback

        def final_callback_without_reshard(state: Any) -> None:
            reshard = handle_cls.reshard
            handle_cls.reshard = lambda self: None  # type: ignore[method-assign]
            try:
                original(state)
            finally:
                handle_cls.reshard = reshard  # type: ignore[method-assign]

        unit_mod._final_callback = final_callback_without_reshard
        setattr(unit_mod, "_mutant_patched", True)  # noqa: B010


class NoSyncModuleStates(_Mutant):
    """Accepts ``sync_module_states=True`` but never broadcasts rank 0's states."""

    name = "mutant-no-sync-module-states"
    breaks = "sync_module_states"

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        from dataclasses import replace

        return replace(spec, sync_module_states=False)


class NoExecOrderCheck(_Mutant):
    """Never validates the all-gather order across ranks."""

    name = "mutant-no-exec-order-check"
    breaks = "execution-order validation"

    def _patch_globally(self) -> None:
        import fsdp_impl.exec_order as exec_order

        exec_order.checking_enabled = lambda: False


class NoRegatherForRecompute(_Mutant):
    """Recomputing a checkpointed forward inside backward reuses whatever parameter storage is there."""

    name = "mutant-no-regather-for-recompute"
    breaks = "unsharding before activation-checkpoint recomputation"

    def _patch_globally(self) -> None:
        import fsdp_impl.unit as unit_mod

        if getattr(unit_mod, "_mutant_recompute_patched", False):  # noqa: B009
            return
        pre_forward = unit_mod._pre_forward

        def pre_forward_without_regather(unit: Any, state: Any, recompute: bool) -> None:
            if not recompute:
                pre_forward(unit, state, recompute)

        unit_mod._pre_forward = pre_forward_without_regather
        setattr(unit_mod, "_mutant_recompute_patched", True)  # noqa: B010


class NoPrefetch(_Mutant):
    """Ignores forward/backward prefetch requests: every all-gather is issued when its unit runs."""

    name = "mutant-no-prefetch"
    breaks = "prefetching (communication/compute overlap)"

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        from dataclasses import replace

        return replace(spec, forward_prefetch=False, backward_prefetch=None)


class ChecksEvalForwards(_Mutant):
    """Validates (and records) the all-gather order of eval-mode forwards as if they were training."""

    name = "mutant-checks-eval-forwards"
    breaks = "skipping order checks for eval forwards"

    def _patch_globally(self) -> None:
        from fsdp_impl.exec_order import ExecOrderData

        if getattr(ExecOrderData, "_mutant_patched", False):  # noqa: B009
            return
        record = ExecOrderData.record_pre_forward

        def record_always_training(data: Any, unit: Any, is_training: bool) -> None:
            record(data, unit, True)

        ExecOrderData.record_pre_forward = record_always_training  # type: ignore[method-assign,assignment]
        setattr(ExecOrderData, "_mutant_patched", True)  # noqa: B010


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

        if getattr(init, "_mutant_patched", False):  # noqa: B009
            return
        strict = init._hybrid_groups

        def lenient(process_group: Any, strategy: Any, mesh: Any, auto_wrapping: bool) -> Any:
            if process_group is None and mesh is None:
                return init._auto_hybrid_groups(init.ranks_per_node())
            if process_group is not None and not isinstance(process_group, tuple):
                return init.Groups(process_group, None)
            return strict(process_group, strategy, mesh, auto_wrapping)

        init._hybrid_groups = lenient
        setattr(init, "_mutant_patched", True)  # noqa: B010


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


class HooksOnPlainTensorOutputsOnly(_Mutant):
    """Registers backward hooks only when a unit returns a bare tensor (not tuples, namedtuples)."""

    name = "mutant-hooks-on-plain-outputs-only"
    breaks = "pre-backward hooks on every tensor of structured outputs"

    def _patch_globally(self) -> None:
        import torch

        import fsdp_impl.unit as unit_mod

        def plain_tensors_only(tree: Any, is_leaf: Any = None) -> Any:
            return ([tree] if isinstance(tree, torch.Tensor) else [], None)

        unit_mod.tree_flatten = plain_tensors_only  # type: ignore[assignment]


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

        if getattr(FSDP, "_mutant_patched", False):  # noqa: B009
            return
        check = FSDP._check_ready_for_training

        def check_without_optim_in_backward(unit: Any) -> None:
            flat = unit._handle.flat_param if unit._handle is not None else None
            if flat is not None and hasattr(flat, "_in_backward_optimizers"):
                del flat._in_backward_optimizers
            check(unit)

        FSDP._check_ready_for_training = check_without_optim_in_backward  # type: ignore[method-assign,assignment]
        setattr(FSDP, "_mutant_patched", True)  # noqa: B010


class ZeroGradForUnused(_Mutant):
    """Gives units that took no part in the loss a zero gradient instead of ``None``."""

    name = "mutant-zero-grad-for-unused"
    breaks = "grad None for parameters unused in forward"

    def _patch_globally(self) -> None:
        import torch

        import fsdp_impl.unit as unit_mod

        if getattr(unit_mod, "_mutant_zero_patched", False):  # noqa: B009
            return
        final = unit_mod._final_callback

        def final_with_zero_grads(state: Any) -> None:
            final(state)
            for unit in state.units:
                handle = unit._handle
                if handle is not None and handle.sharded_grad() is None:
                    handle.accumulate_sharded_grad(torch.zeros_like(handle.flat_param))

        unit_mod._final_callback = final_with_zero_grads
        setattr(unit_mod, "_mutant_zero_patched", True)  # noqa: B010


class FirstGradPieceOnly(_Mutant):
    """Reduces only the first gradient a unit's flat parameter accumulates per backward."""

    name = "mutant-first-grad-piece-only"
    breaks = "reducing every gradient piece a unit receives in one backward"

    def _patch_globally(self) -> None:
        import fsdp_impl.unit as unit_mod

        if getattr(unit_mod, "_mutant_first_piece", False):  # noqa: B009
            return
        post_backward = unit_mod._post_backward_hook
        final = unit_mod._final_callback

        def post_backward_once(unit: Any, full: Any) -> None:
            if getattr(unit, "_mutant_reduced", False):
                full.grad = None
                return
            if full.grad is not None:
                unit._mutant_reduced = True
            post_backward(unit, full)

        def final_clearing(state: Any) -> None:
            final(state)
            for unit in state.units:
                unit._mutant_reduced = False

        unit_mod._post_backward_hook = post_backward_once
        unit_mod._final_callback = final_clearing
        setattr(unit_mod, "_mutant_first_piece", True)  # noqa: B010


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

        if getattr(init, "_mutant_assumes_params", False):  # noqa: B009
            return
        place = init.place_module

        def place_first_param(root: Any, ignored: Any, device: Any, param_init_fn: Any) -> Any:
            next(root.parameters())  # StopIteration for a parameterless module
            return place(root, ignored, device, param_init_fn)

        init.place_module = place_first_param
        setattr(init, "_mutant_assumes_params", True)  # noqa: B010


class NoNestedBackwardGuard(_Mutant):
    """Reshards a unit after the first gradient piece even when a nested (reentrant) backward delivered it."""

    name = "mutant-no-nested-backward-guard"
    breaks = "keeping parameters for the outer backward after a reentrant checkpoint's nested backward"

    def _patch_globally(self) -> None:
        import torch

        import fsdp_impl.unit as unit_mod

        if getattr(unit_mod, "_mutant_nested_patched", False):  # noqa: B009
            return
        post_backward = unit_mod._post_backward_hook

        def post_backward_in_outer_task(unit: Any, full: Any) -> None:
            unit._backward_task = torch._C._current_graph_task_id()
            post_backward(unit, full)

        unit_mod._post_backward_hook = post_backward_in_outer_task
        setattr(unit_mod, "_mutant_nested_patched", True)  # noqa: B010


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


class OffloadedGradsDropped(_Mutant):
    """With parameter CPU offload, reduced gradients never reach the offloaded parameters."""

    name = "mutant-offloaded-grads-dropped"
    breaks = "gradients of CPU-offloaded parameters"

    def _patch_globally(self) -> None:
        from fsdp_impl.flat_param import FlatParamHandle

        if getattr(FlatParamHandle, "_mutant_offload_patched", False):  # noqa: B009
            return
        accumulate = FlatParamHandle.accumulate_sharded_grad

        def accumulate_unless_offloaded(handle: Any, grad: Any) -> None:
            if not handle.offload_params:
                accumulate(handle, grad)

        FlatParamHandle.accumulate_sharded_grad = accumulate_unless_offloaded  # type: ignore[method-assign,assignment]
        setattr(FlatParamHandle, "_mutant_offload_patched", True)  # noqa: B010


# -- placement mutants: only GPU rows can see them (on a CPU-only machine the CPU is both
# -- the target and the fallback device); their expectations declare the GPUs they need.
class DeviceIdIgnored(_Mutant):
    """Accepts ``device_id`` and drops it: modules stay where they are built."""

    name = "mutant-device-id-ignored"
    breaks = "device_id"

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        from dataclasses import replace

        return replace(spec, device_id=None)


class DeviceIdNotPropagated(_Mutant):
    """Gives ``device_id`` to the unit it was passed to, not to the units auto-wrapping creates."""

    name = "mutant-device-id-not-propagated"
    breaks = "device_id reaching auto-wrapped units"

    def _patch_globally(self) -> None:
        import threading

        import fsdp_impl.init as init
        import fsdp_impl.wrap as wrap

        if getattr(wrap, "_mutant_patched", False):  # noqa: B009
            return
        auto_wrap, resolve = wrap.auto_wrap, init.resolve_device_id
        inside = threading.local()  # thread ranks share these modules

        def auto_wrap_without_device(root: Any, policy: Any, ignored: Any, make_unit: Any) -> Any:
            def make_unit_without_device(module: Any) -> Any:
                inside.active = True
                try:
                    return make_unit(module)
                finally:
                    inside.active = False

            return auto_wrap(root, policy, ignored, make_unit_without_device)

        def resolve_outside_auto_wrap(device_id: Any) -> Any:
            return None if getattr(inside, "active", False) else resolve(device_id)

        wrap.auto_wrap = auto_wrap_without_device
        init.resolve_device_id = resolve_outside_auto_wrap
        setattr(wrap, "_mutant_patched", True)  # noqa: B010


class OffloadDroppedWithDeviceId(_Mutant):
    """With ``device_id`` given, parameter CPU offload is silently turned off."""

    name = "mutant-offload-dropped-with-device-id"
    breaks = "CPU offload together with device_id"

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        from dataclasses import replace

        return replace(spec, cpu_offload=False) if spec.device_id is not None else spec


class MovesCpuModuleSilently(_Mutant):
    """Builds flat parameters on the compute device even when the module was left on the CPU."""

    name = "mutant-moves-cpu-module-silently"
    breaks = "leaving a CPU module (no device_id) on the CPU until the user moves it"

    def _patch_globally(self) -> None:
        import torch

        from fsdp_impl.flat_param import FlatParamHandle

        def compute_or_cpu(handle: Any) -> Any:
            return torch.device("cpu") if handle.offload_params else handle.compute_device

        FlatParamHandle._storage_device = compute_or_cpu  # type: ignore[method-assign,assignment]


class ConsolidatesDevices(_Mutant):
    """Moves a module spread over several devices onto its first accelerator instead of rejecting it."""

    name = "mutant-consolidates-devices"
    breaks = "rejecting modules spread over several devices"

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        devices = [p.device for p in module.parameters() if p.device.type != "cpu"]
        if devices:
            module.to(devices[0])
        return super().wrap(module, spec)


MUTANTS: dict[str, type[_Mutant]] = {
    cls.name: cls for cls in (NoGradDivide, WrongReplicateGroup, NoReshardAfterBackward,
                              NoSyncModuleStates, NoExecOrderCheck, NoRegatherForRecompute,
                              NoPrefetch, ChecksEvalForwards, Silent,
                              LenientHybridGroups, NoHomogeneityCheck, UnsafeSetattrIgnored,
                              HooksOnPlainTensorOutputsOnly, ShardedLoadIgnored, NoOptimInBackwardCheck,
                              ZeroGradForUnused, FirstGradPieceOnly, NoNestedBackwardGuard,
                              IgnoredModulesManaged, AssumesParameters, DeviceIdIgnored,
                              DeviceIdNotPropagated, OffloadDroppedWithDeviceId, MovesCpuModuleSilently,
                              ConsolidatesDevices, AutoWrapChildrenOnly,
                              OffloadedGradsDropped)
}

