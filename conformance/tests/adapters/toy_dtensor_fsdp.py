"""A per-parameter FSDP in one screen, written on DTensor, for testing the suite (not an implementation to use).

Every parameter becomes a ``DTensor`` sharded ``Shard(0)`` on a 1-D
``DeviceMesh`` over the world, and a parametrization gathers it when the
module reads it: ``redistribute`` to ``Replicate()`` (a functional all-gather)
and ``to_local`` whose gradient is ``Partial(reduce)``, so backward
reduce-scatters the gradient back to ``Shard(0)`` through DTensor (a
functional reduce-scatter). Nothing here calls a ``torch.distributed``
collective, installs a hook, or has units in FSDP1's sense; every gather is
waited for at once, so nothing overlaps.

``reduce="avg"`` (:class:`ToyDTensorAdapter`) gives DDP's gradients, the mean
over ranks (the gradient contract, docs/ADAPTER_GUIDE.md);
``reduce="sum"`` (:class:`ToySummingAdapter`) sums them, the mistake the
parity helper diagnoses. ``param_dtype`` casts the shard before gathering
(all-gather and reduce-scatter then carry that dtype).

Register it without packaging, e.g. for ``fsdp-conformance run``:
``FSDP_CONFORMANCE_ADAPTERS="toy-dtensor=conformance.tests.adapters.toy_dtensor_fsdp:ToyDTensorAdapter"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize

from conformance.contract.adapter import Capability, UnitInfo, WrapSpec

__all__ = ["toy_fully_shard", "ToyDTensorAdapter", "ToySummingAdapter"]


class _Gather(nn.Module):
    """The parametrization: the full parameter from its shard, reduced as ``reduce`` in backward."""

    def __init__(self, reduce: str, param_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.reduce, self.param_dtype = reduce, param_dtype

    def forward(self, shard: DTensor) -> torch.Tensor:
        cast = shard if self.param_dtype is None else shard.to(self.param_dtype)
        assert isinstance(cast, DTensor)
        full = cast.redistribute(shard.device_mesh, [Replicate()])
        return full.to_local(grad_placements=[Partial(self.reduce)])


def toy_fully_shard(module: nn.Module, mesh: DeviceMesh, *, reduce: str = "avg",
                    param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard every parameter of ``module`` in place; returns ``module``."""
    if reduce not in ("avg", "sum"):
        raise ValueError(f"reduce={reduce!r}: expected 'avg' (the contract) or 'sum'")
    for owner in list(module.modules()):
        for name, param in list(owner.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # sharded by an earlier (inner) call
                continue
            shard = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
            delattr(owner, name)
            owner.register_parameter(name, shard)
            parametrize.register_parametrization(owner, name, _Gather(reduce, param_dtype), unsafe=True)
    return module


def _sharded(model: nn.Module) -> dict[str, DTensor]:
    """Unwrapped parameter name -> its DTensor shard."""
    out: dict[str, DTensor] = {}
    for prefix, owner in model.named_modules():
        if not parametrize.is_parametrized(owner):
            continue
        for name, plist in owner.parametrizations.items():  # type: ignore[union-attr]
            out[f"{prefix}.{name}" if prefix else name] = plist.original
    return out


class ToyDTensorAdapter:
    """The toy as an adapter: FULL_SHARD only, per parameter, gradients averaged."""

    name = "toy-dtensor"
    protocol_version = 2
    capabilities = frozenset({Capability.THREAD_RANKS, Capability.FULL_STATE_DICT})
    reduce = "avg"

    def unavailable_reason(self) -> str | None:
        return None

    def supports_strategy(self, strategy: str | None) -> bool:
        return strategy in (None, "FULL_SHARD")

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        device = next(module.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        dtype = spec.mixed_precision.param_dtype if spec.mixed_precision is not None else None
        return toy_fully_shard(module, mesh, reduce=self.reduce, param_dtype=dtype)

    def units(self, model: nn.Module) -> list[UnitInfo]:
        """One unit per module that owns parameters (the toy communicates per parameter)."""
        units = []
        for fqn, owner in model.named_modules():
            if not parametrize.is_parametrized(owner):
                continue
            shards = [plist.original for plist in owner.parametrizations.values()]  # type: ignore[union-attr]
            units.append(UnitInfo(fqn, owner, shards[0].device_mesh.get_group(), None, shards[0].device,
                                  [s.to_local() for s in shards],
                                  [None if s.grad is None else s.grad.to_local() for s in shards], None))
        return units

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: shard.full_tensor().detach().clone() for name, shard in _sharded(model).items()}

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        grads = {name: shard.grad for name, shard in _sharded(model).items()}
        return {name: g.full_tensor() if isinstance(g, DTensor) else g for name, g in grads.items()}

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        state = dict(self.full_params(model))
        state.update({name: buf.detach().clone() for name, buf in model.named_buffers()})
        return state

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        raise ValueError(f"{self.name}: no sharded state dict (SHARDED_STATE_DICT is not declared)")

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        if sharded:
            raise ValueError(f"{self.name}: no sharded state dict (SHARDED_STATE_DICT is not declared)")
        with torch.no_grad():
            for name, shard in _sharded(model).items():
                full = state[name].to(shard.device)
                shard.copy_(distribute_tensor(full, shard.device_mesh, [Shard(0)]))

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool) -> dict[str, Any]:
        raise ValueError(f"{self.name}: no optimizer state dict (not declared)")

    def load_optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], *,
                              sharded: bool) -> None:
        raise ValueError(f"{self.name}: no optimizer state dict (not declared)")


class ToySummingAdapter(ToyDTensorAdapter):
    """The same toy, summing gradients over ranks where the contract averages."""

    name = "toy-dtensor-sum"
    reduce = "sum"
