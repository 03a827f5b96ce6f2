"""Placement mutants: only GPU rows can see them.

On a CPU-only machine the CPU is both where ``device_id`` points and where a
module falls back to, so these are caught by the GPU rows, and their
expectations declare the GPUs they need.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn as nn

from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.contract.adapter import WrapSpec
from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = [
    "DeviceIdIgnored",
    "DeviceIdNotPropagated",
    "DeviceIndexResolvedSilently",
    "OffloadDroppedWithDeviceId",
    "MovesCpuModuleSilently",
    "ConsolidatesDevices",
    "IgnoredModulesMoved",
    "PostOptimEventIgnored",
]

Fn = Callable[..., Any]


class DeviceIdIgnored(_Mutant):
    """Accepts ``device_id`` and drops it: modules stay where they are built."""

    name = "mutant-device-id-ignored"
    breaks = "device_id"
    expect = Expect(
        "device_id or cpu_gpu_module or cpu_init_with_sync_module_states", "process",
        ("placement/device_id", "placement/device_id_auto_wrap[on=gpu]", "placement/cpu_gpu_module",
         "placement/cpu_init_with_sync_module_states", "placement/module_device_mismatches_device_id[has_params=True]",
         "placement/module_device_mismatches_device_id[has_params=False]"),
        accelerators=2,
    )
    spec_overrides = {"device_id": None}


_inside_auto_wrap = threading.local()  # thread ranks share the patched modules


def _auto_wrap_flagging_children(auto_wrap: Fn) -> Fn:
    def auto_wrap_flagged(root: Any, policy: Any, ignored: Any, make_unit: Any) -> Any:
        def make_unit_flagged(module: Any) -> Any:
            _inside_auto_wrap.active = True
            try:
                return make_unit(module)
            finally:
                _inside_auto_wrap.active = False

        return auto_wrap(root, policy, ignored, make_unit_flagged)

    return auto_wrap_flagged


def _resolve_outside_auto_wrap(resolve: Fn) -> Fn:
    def resolve_unless_auto_wrapping(device_id: Any) -> Any:
        return None if getattr(_inside_auto_wrap, "active", False) else resolve(device_id)

    return resolve_unless_auto_wrapping


class DeviceIdNotPropagated(_Mutant):
    """Gives ``device_id`` to the unit it was passed to, not to the units auto-wrapping creates."""

    name = "mutant-device-id-not-propagated"
    breaks = "device_id reaching auto-wrapped units"
    expect = Expect("device_id_auto_wrap and gpu", "process", ("placement/device_id_auto_wrap[on=gpu]",),
                    accelerators=2)
    patches = (
        Patch("fsdp_impl.wrap:auto_wrap", _auto_wrap_flagging_children),
        Patch("fsdp_impl.init:resolve_device_id", _resolve_outside_auto_wrap),
    )


def _resolve_without_warning(resolve: Fn) -> Fn:
    def resolve_silently(device_id: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return resolve(device_id)

    return resolve_silently


class DeviceIndexResolvedSilently(_Mutant):
    """Takes the current device for a ``device_id`` without an index, without the warning."""

    name = "mutant-device-index-resolved-silently"
    breaks = "warning about a device_id without an index"
    expect = Expect("device_id_without_index_warns", "process", ("placement/device_id_without_index_warns",),
                    accelerators=2)
    patches = (Patch("fsdp_impl.init:resolve_device_id", _resolve_without_warning),)


class OffloadDroppedWithDeviceId(_Mutant):
    """With ``device_id`` given, parameter CPU offload is silently turned off."""

    name = "mutant-offload-dropped-with-device-id"
    breaks = "CPU offload together with device_id"
    expect = Expect("device_id_cpu_offload and gpu", "process", ("placement/device_id_cpu_offload[on=gpu]",),
                    accelerators=2)

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        return replace(spec, cpu_offload=False) if spec.device_id is not None else spec


def _compute_or_cpu(handle: Any) -> torch.device:
    return torch.device("cpu") if handle.offload_params else handle.compute_device


class MovesCpuModuleSilently(_Mutant):
    """Builds flat parameters on the compute device even when the module was left on the CPU."""

    name = "mutant-moves-cpu-module-silently"
    breaks = "leaving a CPU module (no device_id) on the CPU until the user moves it"
    expect = Expect(
        "cpu_init_stays_on_cpu or training_device_mismatch", "process",
        ("placement/cpu_init_stays_on_cpu", "placement/training_device_mismatch"), accelerators=2,
    )
    patches = (Patch.instead("fsdp_impl.flat_param:FlatParamHandle._storage_device", _compute_or_cpu),)


class ConsolidatesDevices(_Mutant):
    """Moves a module spread over several devices onto its first accelerator instead of rejecting it."""

    name = "mutant-consolidates-devices"
    breaks = "rejecting modules spread over several devices"
    expect = Expect(
        "multigpu_module or cpu_gpu_module_without_device_id_raises", "process",
        ("placement/multigpu_module", "placement/cpu_gpu_module_without_device_id_raises"), accelerators=2,
    )

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        devices = [p.device for p in module.parameters() if p.device.type != "cpu"]
        if devices:
            module.to(devices[0])
        return super().wrap(module, spec)


class IgnoredModulesMoved(_Mutant):
    """Leaves ignored modules unflattened but moves them to ``device_id`` with the rest."""

    name = "mutant-ignored-modules-moved"
    breaks = "leaving ignored modules where they are"
    expect = Expect(
        "ignored_params_not_moved and gpu", "process", ("placement/ignored_params_not_moved[on=gpu]",), accelerators=2,
    )

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        device = spec.device_id
        if device is not None:
            target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            for ignored in spec.ignored_modules:
                ignored.to(target)
        return super().wrap(module, spec)


class PostOptimEventIgnored(TorchFSDP2Adapter):
    """torch-fsdp2 whose ``set_post_optim_event`` is accepted and dropped (the next step waits as before)."""

    name = "mutant-fsdp2-post-optim-event-ignored"
    breaks = "overlapping the next all-gather with the optimizer step"
    # Only torch-fsdp2 has a post-optimizer event, so this mutant derives from its adapter.
    expect: ClassVar[Expect] = Expect(
        "post_optim_event_overlap", "process", ("overlap/post_optim_event_overlap",), accelerators=2,
    )

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        model = super().wrap(module, spec)
        model.set_post_optim_event = lambda event: None  # type: ignore[method-assign,assignment]
        return model
