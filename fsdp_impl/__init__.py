"""A minimal, readable reference implementation of Fully Sharded Data Parallel.

Mirrors ``torch.distributed.fsdp`` for what it supports, so swapping the import
works: ``from fsdp_impl import FullyShardedDataParallel as FSDP`` (FSDP1's
wrapper) or ``from fsdp_impl import fully_shard`` (FSDP2's per-module API).
"""

from fsdp_impl import wrap
from fsdp_impl.api import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_impl.composable import fully_shard
from fsdp_impl.fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from fsdp_impl.fully_sharded_data_parallel import FullyShardedDataParallel

FSDP = FullyShardedDataParallel

__all__ = [
    "FullyShardedDataParallel",
    "FSDP",
    "ShardingStrategy",
    "BackwardPrefetch",
    "CPUOffload",
    "MixedPrecision",
    "StateDictType",
    "OptimStateKeyType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
    "fully_shard",
    "FSDPModule",
    "register_fsdp_forward_method",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "wrap",
]
