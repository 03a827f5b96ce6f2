"""Adapter for torchtitan's SimpleFSDP (torchtitan 0.3.0), a per-parameter FSDP written on DTensor.

An optional extra: ``pip install --no-deps torchtitan==0.3.0 tyro docstring_parser spmd_types``
(``--no-deps`` so that it never replaces the installed torch). Without it the
adapter is unavailable, with the reason.

[Note: SimpleFSDP mapping]
SimpleFSDP (``torchtitan.experiments.graph_trainer.simple_fsdp.data_parallel``)
turns every parameter of every module into a ``DTensor`` and swaps each
module's class for a subclass whose parameter attributes are properties: a
read ``redistribute``s the shard to ``Replicate()`` (an all-gather, in
``param_dtype``) and hands out the local tensor whose gradient is
``Partial("sum")``, so backward reduce-scatters (or all-reduces) it in
``reduce_dtype``. It has no units, hooks or wrap policy; resharding and
overlap are left to ``torch.compile``, and this adapter runs it eagerly.

==================== ========================== =============================
strategy             mesh                        ``mode``
==================== ========================== =============================
FULL_SHARD, None     1-D (world,)               ``fully_shard``
SHARD_GRAD_OP        1-D (world,)               ``fully_shard`` (no switch)
NO_SHARD             1-D (world,)               ``replicate``
HYBRID_SHARD         2-D (replicate, shard)     ``hybrid_shard``
_HYBRID_SHARD_ZERO2  2-D (replicate, shard)     ``hybrid_shard`` (no switch)
==================== ========================== =============================

SimpleFSDP has no ``reshard_after_forward``: eagerly, autograd keeps each
gathered parameter for backward, so FULL_SHARD and SHARD_GRAD_OP behave alike.
A hybrid wrap needs a 2-D mesh or a ``(shard, replicate)`` group pair.
``auto_wrap`` changes nothing (every parameter is sharded on its own);
``units()`` reports one unit per module that owns parameters. ``device_id``
moves the module there first (SimpleFSDP computes where the parameters are).
Parameters keep their names (``named_parameters()`` and ``state_dict()`` hold
the DTensors themselves), so the sharded state dict is ``state_dict()``, and
optimizer state dicts go through ``torch.distributed.checkpoint.state_dict``.

SimpleFSDP caches the generated classes per (module class, parameter names)
in a module-level dict, and a cached class reads through the first wrapped
module's parametrization, its mesh and mixed-precision policy included
(``docs/findings/titan-simple-fsdp-class-cache.md``). ``wrap`` empties that
cache first so that each wrap uses its own settings; for the same reason the
thread column is ``n/a`` (ranks that are threads share the cache).
It sums gradients over ranks where the contract averages
(``docs/findings/titan-simple-fsdp-sums-gradients.md``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.adapters._inexpressible import refuse_inexpressible
from conformance.contract.adapter import HYBRID_STRATEGIES, Capability, UnitInfo, WrapSpec
from fixtures.meshes import hybrid_grid_of

__all__ = ["TorchTitanSimpleFSDPAdapter"]

_VERSION = "0.3.0"
_INSTALL = f"pip install --no-deps torchtitan=={_VERSION} tyro docstring_parser spmd_types"
_STRATEGIES = (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", *HYBRID_STRATEGIES)


def _simple_fsdp() -> Any:
    from torchtitan.experiments.graph_trainer import simple_fsdp

    return simple_fsdp


def _dtensors(model: nn.Module) -> dict[str, Any]:
    """Parameter name -> the stored (sharded or replicated) DTensor, read without gathering."""
    return dict(model.named_parameters())


class TorchTitanSimpleFSDPAdapter:
    """``torchtitan``'s ``simple_fsdp.data_parallel`` (see [Note: SimpleFSDP mapping])."""

    name = "torchtitan-simple-fsdp"
    protocol_version = 3
    capabilities = frozenset(
        {
            Capability.COMPUTE_DEVICE,
            Capability.DEVICE_MESH,
            Capability.HYBRID_VIA_PG_TUPLE,
            Capability.OPTIM_STATE_DICT,
            Capability.MIXED_PRECISION,
            Capability.FULL_STATE_DICT,
            Capability.SHARDED_STATE_DICT,
        }
    )

    def unavailable_reason(self) -> str | None:
        try:
            from importlib.metadata import version

            _simple_fsdp()
            installed = version("torchtitan")
        except Exception as exc:  # noqa: BLE001 - any import failure makes the adapter unusable
            return f"{type(exc).__name__}: {exc} (install with: {_INSTALL})"
        if installed != _VERSION:
            return f"torchtitan {installed} is installed; this adapter is written for {_VERSION}"
        return None

    def supports_strategy(self, strategy: str | None) -> bool:
        return strategy in _STRATEGIES

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        sf = _simple_fsdp()
        if spec.device_id is not None:  # SimpleFSDP computes where the parameters are
            module.to(_device(spec))
        kwargs = self._kwargs(spec)
        sf._wrap_class_cache.clear()  # see [Note: SimpleFSDP mapping]
        return sf.data_parallel(module, **kwargs)  # type: ignore[no-any-return]

    def _kwargs(self, spec: WrapSpec) -> dict[str, Any]:
        refuse_inexpressible(self.name, spec, strategies=_STRATEGIES, features=(
            "cpu_offload", "sync_module_states", "ignored_modules", "param_init_fn"))
        mode = {"NO_SHARD": "replicate", **dict.fromkeys(HYBRID_STRATEGIES, "hybrid_shard")}.get(
            spec.strategy or "", "fully_shard")
        kwargs: dict[str, Any] = {"device_mesh": self._mesh(spec, _device(spec).type), "mode": mode}
        mp = spec.mixed_precision
        if mp is not None:
            # The spec's reduce_dtype=None is the param dtype; SimpleFSDP's None is the parameter's own dtype.
            kwargs["mp_policy"] = _simple_fsdp().MixedPrecisionPolicy(
                param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype or mp.param_dtype)
        kwargs.update(spec.extra)
        return kwargs

    def _mesh(self, spec: WrapSpec, device_type: str) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if spec.device_mesh is not None:
            return spec.device_mesh
        pg = spec.process_group
        if isinstance(pg, tuple):
            shard, replicate = pg
            return DeviceMesh.from_group([replicate, shard], device_type, mesh=hybrid_grid_of(shard, replicate),
                                         mesh_dim_names=("replicate", "shard"))
        if spec.strategy in HYBRID_STRATEGIES:
            raise ValueError(f"{self.name} needs a 2-D device_mesh or a (shard, replicate) process_group "
                             f"for {spec.strategy}; it does not build node-local groups itself")
        if pg is not None:
            return DeviceMesh.from_group(pg, device_type)
        return init_device_mesh(device_type, (dist.get_world_size(),))

    def units(self, model: nn.Module) -> list[UnitInfo]:
        """One unit per module that owns parameters (SimpleFSDP communicates per parameter)."""
        out = []
        for fqn, owner in model.named_modules():
            shards = [p for p in owner.parameters(recurse=False) if hasattr(p, "device_mesh")]
            if not shards:
                continue
            mesh = shards[0].device_mesh
            shard_group = mesh.get_group(mesh.ndim - 1)
            replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
            out.append(UnitInfo(fqn, owner, shard_group, replicate_group, shards[0].device,
                                [s.to_local() for s in shards],
                                [None if s.grad is None else s.grad.to_local() for s in shards], None))
        return out

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: _full(p).detach().clone() for name, p in _dtensors(model).items()}

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """Each parameter's gradient as SimpleFSDP leaves it, gathered from its shards."""
        return {name: None if p.grad is None else _full(p.grad).detach().clone()
                for name, p in _dtensors(model).items()}

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return {name: _full(value).detach().clone() for name, value in model.state_dict().items()}

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return dict(model.state_dict())

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        if sharded:
            model.load_state_dict(state)
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        own = model.state_dict()
        converted = {}
        for name, value in state.items():
            target = own.get(name)
            if isinstance(target, DTensor) and not isinstance(value, DTensor):
                value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements)
            converted[name] = value
        model.load_state_dict(converted)

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=not sharded))

    def load_optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], *, sharded: bool
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optim, state, options=StateDictOptions(full_state_dict=not sharded))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _device(spec: WrapSpec) -> torch.device:
    """``device_id`` as a device; without one, the accelerator when there is one."""
    if spec.device_id is not None:
        dev = spec.device_id
        return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _full(tensor: Any) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
