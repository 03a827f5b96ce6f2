"""Placement mutants: only GPU rows can see them.

On a CPU-only machine the CPU is both where ``device_id`` points and where a
module falls back to, so these are caught by the GPU rows, and their
expectations declare the GPUs they need.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch.nn as nn

from conformance.adapters.base import WrapSpec
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.mutants._base import _Mutant, patch_once

__all__ = [
    "DeviceIdIgnored",
    "DeviceIdNotPropagated",
    "OffloadDroppedWithDeviceId",
    "MovesCpuModuleSilently",
    "ConsolidatesDevices",
    "IgnoredModulesMoved",
    "PostOptimEventIgnored",
]


class DeviceIdIgnored(_Mutant):
    """Accepts ``device_id`` and drops it: modules stay where they are built."""

    name = "mutant-device-id-ignored"
    breaks = "device_id"
    spec_overrides = {"device_id": None}


class DeviceIdNotPropagated(_Mutant):
    """Gives ``device_id`` to the unit it was passed to, not to the units auto-wrapping creates."""

    name = "mutant-device-id-not-propagated"
    breaks = "device_id reaching auto-wrapped units"

    def _patch_globally(self) -> None:
        import threading

        import fsdp_impl.init as init
        import fsdp_impl.wrap as wrap

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

        patch_once(wrap, "auto_wrap", auto_wrap_without_device)
        patch_once(init, "resolve_device_id", resolve_outside_auto_wrap)


class OffloadDroppedWithDeviceId(_Mutant):
    """With ``device_id`` given, parameter CPU offload is silently turned off."""

    name = "mutant-offload-dropped-with-device-id"
    breaks = "CPU offload together with device_id"

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
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


class IgnoredModulesMoved(_Mutant):
    """Leaves ignored modules unflattened but moves them to ``device_id`` with the rest."""

    name = "mutant-ignored-modules-moved"
    breaks = "leaving ignored modules where they are"

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        import torch

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

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        model = super().wrap(module, spec)
        model.set_post_optim_event = lambda event: None  # type: ignore[method-assign,assignment]
        return model
