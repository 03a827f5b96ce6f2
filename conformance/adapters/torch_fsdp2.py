"""Adapter for PyTorch's per-parameter FSDP (``fully_shard``, "FSDP2").

[Note: FSDP2 strategy mapping]
FSDP2 has no ``ShardingStrategy``; the FSDP1 strategies map onto a mesh and
``reshard_after_forward``:

==================== ========================== =======================
strategy             mesh                        reshard_after_forward
==================== ========================== =======================
FULL_SHARD           1-D (world,)               True
SHARD_GRAD_OP        1-D (world,)               False
NO_SHARD             2-D (world, 1) replicate   True (nothing to free)
HYBRID_SHARD         2-D (replicate, shard)     True
_HYBRID_SHARD_ZERO2  2-D (replicate, shard)     False
==================== ========================== =======================

A hybrid wrap needs a 2-D mesh or a ``(shard, replicate)`` group pair; FSDP2
does not build node-local groups itself, so cases that need that are not
applicable. Units are ``fully_shard`` applied bottom-up to every module the
auto-wrap spec selects, then to the root.

[Note: FSDP2 device_id]
``fully_shard`` has no ``device_id``: the mesh's device type decides where the
managed parameters and buffers live and compute, at the accelerator's current
index, and ``fully_shard`` moves them there itself (meta tensors stay on meta,
ignored parameters stay where they are). ``WrapSpec.device_id`` therefore picks
the mesh's device type; a device index other than the current one cannot be
expressed and is rejected rather than silently replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.adapters._composable import FullyShardMethods
from conformance.contract.adapter import HYBRID_STRATEGIES, Capability, UnitInfo, WrapSpec
from fixtures.meshes import hybrid_grid_of

__all__ = ["TorchFSDP2Adapter"]

CPU = torch.device("cpu")


class TorchFSDP2Adapter(FullyShardMethods):
    """``torch.distributed.fsdp.fully_shard`` over a DeviceMesh."""

    name = "torch-fsdp2"
    protocol_version = 3
    capabilities = frozenset(
        {
            Capability.HYBRID_VIA_PG_TUPLE,
            Capability.DEVICE_MESH,
            Capability.RESHARD_INTROSPECTION,
            Capability.POST_OPTIM_EVENT,
            Capability.NO_SYNC,
            Capability.CPU_OFFLOAD,
            Capability.FULL_STATE_DICT,
            Capability.SHARDED_STATE_DICT,
            Capability.THREAD_RANKS,
            Capability.MANUAL_NESTING,
            Capability.OPTIM_STATE_DICT,
            Capability.MIXED_PRECISION,
            Capability.MP_CAST_FORWARD_INPUTS,
            Capability.FULLY_SHARD,
            Capability.RESHARD_AFTER_FORWARD_INT,
            Capability.FULLY_SHARD_MIXED_PRECISION,
            Capability.MP_OUTPUT_DTYPE,
            Capability.SHARD_PLACEMENT_FN,
            Capability.FULLY_SHARD_MODULE_GROUPS,
            Capability.CUSTOM_COMMS,
            Capability.REDUCE_SCATTER_UNUSED_PARAMS,
            Capability.FULLY_SHARD_DP_MESH_DIMS,
            Capability.FULLY_SHARD_TENSOR_PARALLEL,
            Capability.EXPLICIT_PREFETCH,
            Capability.FULLY_SHARD_CONTROLS,
            Capability.SET_RESHARD_AFTER_FORWARD,
            Capability.GRADIENT_DIVIDE_FACTOR,
            Capability.REDUCE_SCATTER_DIVIDE_FACTOR,
            Capability.ALL_REDUCE_CONTROLS,
            Capability.RESET_ITER_STATE,
            Capability.IS_LAST_BACKWARD,
            Capability.UNSHARD_IN_BACKWARD,
            Capability.FORWARD_METHODS,
            Capability.META_INIT,
            Capability.DCP_RESHARD,
            Capability.COMPUTE_DEVICE,
            Capability.IGNORED_MODULES,
        }
    )
    #: FSDP2's options that promise speed or memory only ([Note: performance knobs] in
    #: conformance.cases.test_neutrality), each turned on by :meth:`set_performance_knob`.
    performance_knobs = frozenset({"share_comm_ctx", "separate_reduce_scatter_group", "reduce_scatter_input_buffers",
                                   "allocate_from_process_group", "force_sum_reduction", "symm_mem_for_comm"})
    #: Those given at construction (:meth:`knob_specs`): ``CPUOffloadPolicy.pin_memory``.
    wrap_knobs = frozenset({"offload_pin_memory"})

    def unavailable_reason(self) -> str | None:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401 - importing is the probe
        except Exception as exc:  # noqa: BLE001 - any import failure makes the adapter unusable
            return f"{type(exc).__name__}: {exc}"
        return None

    def supports_strategy(self, strategy: str | None) -> bool:
        return True

    # -- wrapping -------------------------------------------------------------
    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        # FSDP2 always exposes the original parameters, so use_orig_params=False
        # is accepted; cases that rely on a flat parameter require Capability.FLAT_PARAM.
        # A spec needing a capability not declared above never reaches here
        # ([Note: requirements are checked once] in conformance.contract.declared).
        mp = spec.mixed_precision
        device = self._device(spec)
        mesh = self._mesh(spec, device)
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": spec.strategy not in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"),
        }
        if spec.cpu_offload:
            # Pinned host memory needs an accelerator; without one, offload unpinned.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if spec.ignored_modules:
            kwargs["ignored_params"] = {p for m in spec.ignored_modules for p in m.parameters()}
        if mp is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                                     output_dtype=mp.output_dtype)
        kwargs.update(spec.extra)
        if spec.auto_wrap is not None:
            for submodule in reversed(spec.auto_wrap.units_under(module, spec.ignored_modules)):
                fully_shard(submodule, **kwargs)
        return cast(nn.Module, fully_shard(module, **kwargs))

    @staticmethod
    def _device(spec: WrapSpec) -> torch.device:
        """The device the mesh is built for ([Note: FSDP2 device_id])."""
        dev = spec.device_id
        if dev is None:
            if spec.device_mesh is not None:
                return torch.device(spec.device_mesh.device_type)
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
        device = torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
        if spec.device_mesh is not None and spec.device_mesh.device_type != device.type:
            raise ValueError(
                f"torch-fsdp2 adapter: device_id {device} contradicts the {spec.device_mesh.device_type} device_mesh"
            )
        if device.type == "cpu" or device.index is None:
            return device
        current = getattr(torch, device.type).current_device()
        if device.index != current:
            raise ValueError(
                f"torch-fsdp2 adapter: fully_shard computes on the current {device.type} device "
                f"({device.type}:{current}); it cannot honour device_id {device}"
            )
        return device

    @staticmethod
    def _mesh(spec: WrapSpec, device: torch.device) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if spec.device_mesh is not None:
            return spec.device_mesh
        world = dist.get_world_size()
        pg = spec.process_group
        if isinstance(pg, tuple):
            shard, replicate = pg
            return DeviceMesh.from_group(
                [replicate, shard], device.type, mesh=hybrid_grid_of(shard, replicate),
                mesh_dim_names=("replicate", "shard"),
            )
        if pg is not None:
            if spec.strategy == "NO_SHARD":
                raise ValueError(
                    "torch-fsdp2 adapter: NO_SHARD over a given process group needs a 2-D (replicate, 1) mesh; "
                    "pass device_mesh instead of process_group"
                )
            return DeviceMesh.from_group(pg, device.type)
        if spec.strategy == "NO_SHARD":
            return init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
        if spec.strategy in HYBRID_STRATEGIES:
            raise ValueError(
                "torch-fsdp2 needs a 2-D device_mesh or a (shard, replicate) process_group "
                f"for {spec.strategy}; it does not build node-local groups itself"
            )
        return init_device_mesh(device.type, (world,))

    def _fully_shard_fn(self) -> Callable[..., nn.Module]:
        from torch.distributed.fsdp import fully_shard

        return cast(Callable[..., nn.Module], fully_shard)

    def _forward_method_fn(self) -> Callable[[nn.Module, str], None]:
        from torch.distributed.fsdp import register_fsdp_forward_method

        return cast(Callable[[nn.Module, str], None], register_fsdp_forward_method)

    def _mp_policy_cls(self) -> Callable[..., Any]:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return cast(Callable[..., Any], MixedPrecisionPolicy)

    def _dp_mesh_dims_cls(self) -> Callable[..., Any]:
        from torch.distributed.fsdp import DataParallelMeshDims

        return cast(Callable[..., Any], DataParallelMeshDims)

    def wrapped_module(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` shards in place: the model is the user's module."""
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """FSDP2 has no ``no_sync()``: ``set_requires_gradient_sync(False)`` on the root (every unit
        below it, reduce-scatter and HSDP all-reduce alike) for the block, then ``True`` again."""
        root = cast(Any, model)
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def set_post_optim_event(self, model: nn.Module, event: torch.Event) -> None:
        """FSDP2's ``FSDPModule.set_post_optim_event``: the next all-gather waits on ``event``."""
        cast(Any, model).set_post_optim_event(event)

    def set_performance_knob(self, model: nn.Module, knob: str) -> None:
        """Turn one of :attr:`performance_knobs` on for every ``fully_shard``-ed module of ``model``:
        ``share_comm_ctx`` over them all, ``set_separate_reduce_scatter_group(True)`` on the root (recursive by
        default: every unit's reduce-scatter on one group of its own, as a user turns it on), or the
        ``FSDPModule`` setter on each (two reduce-scatter input buffers for ``reduce_scatter_input_buffers``)."""
        from torch.distributed.fsdp import FSDPModule, share_comm_ctx

        units = [cast(Any, unit) for unit in model.modules() if isinstance(unit, FSDPModule)]
        if knob == "share_comm_ctx":
            share_comm_ctx(units)
            return
        if knob == "separate_reduce_scatter_group":
            units[0].set_separate_reduce_scatter_group(True)  # the outermost unit: the root
            return
        turn_on: dict[str, Callable[[Any], None]] = {
            "reduce_scatter_input_buffers": lambda unit: unit.set_reduce_scatter_max_input_buffers(2, recurse=False),
            "allocate_from_process_group": lambda unit: unit.set_allocate_memory_from_process_group_for_comm(True),
            "force_sum_reduction": lambda unit: unit.set_force_sum_reduction_for_comms(True),
            "symm_mem_for_comm": lambda unit: unit.set_symm_mem_for_comm(),
        }
        if knob not in turn_on:
            raise ValueError(f"torch-fsdp2 has no performance knob {knob!r}; it has {sorted(self.performance_knobs)}")
        for unit in units:
            turn_on[knob](unit)

    def knob_specs(self, base: WrapSpec, knob: str) -> tuple[WrapSpec, WrapSpec]:
        """``offload_pin_memory``: ``base`` offloaded to the CPU with ``CPUOffloadPolicy(pin_memory=False)``, then
        with ``pin_memory=True`` (pinning needs an accelerator)."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        if knob != "offload_pin_memory":
            raise ValueError(f"torch-fsdp2 has no wrap-time knob {knob!r}; it has {sorted(self.wrap_knobs)}")
        off, on = ({**base.extra, "offload_policy": CPUOffloadPolicy(pin_memory=pin)} for pin in (False, True))
        return replace(base, cpu_offload=True, extra=off), replace(base, cpu_offload=True, extra=on)

    def set_gradient_divide_factor(self, module: nn.Module, factor: float) -> None:
        """``FSDPModule.set_gradient_divide_factor(factor)``; on CPU over several ranks also
        ``set_force_sum_reduction_for_comms(True)`` (torch's documented option for sum-only backends: gloo refuses
        the ``PREMUL_SUM`` reduction torch uses otherwise; the sum divided by ``factor`` after it is the same value;
        on one rank torch issues no collective, and forcing the sum would divide twice)."""
        super().set_gradient_divide_factor(module, factor)
        self._sum_only_on_cpu(module)

    def set_reduce_scatter_divide_factor(self, module: nn.Module, factor: float) -> None:
        """``FSDPModule.set_reduce_scatter_divide_factor(factor)``, with the sum-only reduction on CPU as
        :meth:`set_gradient_divide_factor`."""
        super().set_reduce_scatter_divide_factor(module, factor)
        self._sum_only_on_cpu(module)

    @staticmethod
    def _sum_only_on_cpu(module: nn.Module) -> None:
        if dist.get_world_size() > 1 and any(param.device.type == "cpu" for param in module.parameters()):
            cast(Any, module).set_force_sum_reduction_for_comms(True)

    # -- introspection ----------------------------------------------------------
    def units(self, model: nn.Module) -> list[UnitInfo]:
        from torch.distributed.fsdp import FSDPModule

        return [
            self._unit_info(fqn, module)
            for fqn, module in model.named_modules()
            if isinstance(module, FSDPModule)
        ]

    @staticmethod
    def _unit_info(fqn: str, unit: Any) -> UnitInfo:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        state = unit._get_fsdp_state()
        group = state._fsdp_param_group
        if group is None:  # no parameters of its own: it still computes on its mesh's device
            return UnitInfo(fqn, unit, None, None, state._device, [], [], True)
        info = group.mesh_info
        params = group.fsdp_params
        return UnitInfo(
            fqn=fqn,
            module=unit,
            shard_group=info.shard_process_group,
            replicate_group=getattr(info, "replicate_process_group", None),
            compute_device=group.device,
            local_shards=[p.sharded_param.to_local() for p in params],
            local_grads=[
                None if p.sharded_param.grad is None else p.sharded_param.grad.to_local()
                for p in params
            ],
            resharded=all(p.sharded_state == ShardedState.SHARDED for p in params),
        )

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, param in model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            out[name] = full.detach().clone()
        return out

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """Each parameter's gradient, gathered from its shards."""
        out: dict[str, torch.Tensor | None] = {}
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is not None and hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            out[name] = None if grad is None else grad.detach().clone()
        return out

    # -- state dicts ------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return dict(model.state_dict())

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=not sharded))

    def optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=not sharded)
        )

    def load_optim_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state: dict[str, Any],
        *,
        sharded: bool,
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            model, optim, state, options=StateDictOptions(full_state_dict=not sharded)
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
