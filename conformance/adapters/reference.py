"""Adapter for this project's reference FSDP, :mod:`fsdp_impl`."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.nn as nn

from conformance.adapters._composable import FullyShardMethods
from conformance.adapters._fsdp1_like import FSDP1LikeAdapter
from conformance.contract.adapter import DEPRECATED_CAPABILITIES, Capability, UnitInfo

__all__ = ["ReferenceAdapter"]


class ReferenceAdapter(FullyShardMethods, FSDP1LikeAdapter):
    """``fsdp_impl.FullyShardedDataParallel``; introspected through its public surface
    (``flat_param``, ``is_resharded``, ``process_group``, ``compute_device``)."""

    name = "reference"
    capabilities = frozenset(Capability) - set(DEPRECATED_CAPABILITIES) - {Capability.POST_OPTIM_EVENT}

    def _api(self) -> ModuleType:
        import fsdp_impl

        return fsdp_impl

    def _fully_shard_fn(self) -> Callable[..., nn.Module]:
        import fsdp_impl

        return fsdp_impl.fully_shard

    def _wrap_api(self) -> ModuleType:
        import fsdp_impl.wrap

        return fsdp_impl.wrap

    def _unit_info(self, fqn: str, module: nn.Module) -> UnitInfo:
        unit: Any = module
        flat = unit.flat_param
        return UnitInfo(
            fqn=fqn,
            module=unit,
            shard_group=unit.process_group,
            replicate_group=unit._inter_node_pg,
            compute_device=unit.compute_device,
            local_shards=[] if flat is None else [flat.detach()],
            local_grads=[] if flat is None else [flat.grad],
            resharded=bool(unit.is_resharded),
            strategy=unit.sharding_strategy.name,
        )
