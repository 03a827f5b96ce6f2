"""Adapter for this project's reference FSDP, :mod:`fsdp_impl`."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.nn as nn

from conformance.adapters._composable import FullyShardMethods
from conformance.adapters._fsdp1_like import FSDP1LikeAdapter
from conformance.contract.adapter import Capability, UnitInfo

__all__ = ["ReferenceAdapter"]


class ReferenceAdapter(FullyShardMethods, FSDP1LikeAdapter):
    """``fsdp_impl.FullyShardedDataParallel``; introspected through its public surface
    (``flat_param``, ``is_resharded``, ``process_group``, ``compute_device``)."""

    name = "reference"
    capabilities = frozenset(
        {
            Capability.EXEC_ORDER_VALIDATION,
            Capability.FLAT_PARAM,
            Capability.MANUAL_NESTING,
            Capability.RESHARD_INTROSPECTION,
            Capability.HYBRID_VIA_PG_TUPLE,
            Capability.HYBRID_AUTO_GROUPS,
            Capability.HYBRID_MANUAL_WRAP_CHECK,
            Capability.HYBRID_PG_VALIDATION,
            Capability.SYNC_MODULE_STATES,
            Capability.CPU_OFFLOAD,
            Capability.IGNORED_MODULES,
            Capability.META_MATERIALIZATION,
            Capability.PARAM_INIT_FUNCTION,
            Capability.COMPUTE_DEVICE,
            Capability.PLACEMENT_MESSAGES,
            Capability.DEVICE_MESH,
            Capability.WORLD_SIZE_1_SWITCH,
            Capability.CONTAINER_WARNING,
            Capability.HOMOGENEOUS_ATTRIBUTES,
            Capability.UNSAFE_SETATTR,
            Capability.OPTIM_IN_BACKWARD_CHECK,
            Capability.FORWARD_PREFETCH,
            Capability.BACKWARD_PREFETCH,
            Capability.NO_SYNC,
            Capability.FULL_STATE_DICT,
            Capability.SHARDED_STATE_DICT,
            Capability.OPTIM_STATE_DICT,
            Capability.MIXED_PRECISION,
            Capability.MP_CAST_FORWARD_INPUTS,
            Capability.MP_KEEP_LOW_PRECISION_GRADS,
            Capability.MP_BUFFER_DTYPE,
            Capability.MP_FULL_PRECISION_IN_EVAL,
            Capability.THREAD_RANKS,
            Capability.OPTIM_STATE_DICT_FUNCTIONS,
            Capability.STATE_DICT_SETTINGS,
            Capability.LOCAL_STATE_DICT,
            Capability.WRAPPER_METHODS,
            Capability.IGNORED_STATES,
            Capability.MP_CAST_UNIT_FORWARD_INPUTS,
            Capability.FULLY_SHARD,
            Capability.RESHARD_AFTER_FORWARD_INT,
            Capability.FULLY_SHARD_MIXED_PRECISION,
            Capability.MP_OUTPUT_DTYPE,
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
            Capability.REDUCE_SCATTER_UNUSED_PARAMS,
            Capability.META_INIT,
            Capability.DCP_RESHARD,
        }
    )

    def _api(self) -> ModuleType:
        import fsdp_impl

        return fsdp_impl

    def _fully_shard_fn(self) -> Callable[..., nn.Module]:
        import fsdp_impl

        return fsdp_impl.fully_shard

    def _forward_method_fn(self) -> Callable[[nn.Module, str], None]:
        import fsdp_impl

        return fsdp_impl.register_fsdp_forward_method

    def _mp_policy_cls(self) -> Callable[..., Any]:
        import fsdp_impl

        return fsdp_impl.MixedPrecisionPolicy

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
            empty_shards=[] if flat is None else [_padding_only(unit._state.handle.layout)],
            resharded=bool(unit.is_resharded),
            strategy=unit.sharding_strategy.name,
        )


def _padding_only(layout: Any) -> bool:
    """Whether this rank's flat shard holds none of the parameters' elements (padding only)."""
    return all(layout.local_range(i) == (0, 0) for i in range(len(layout.shapes)))
