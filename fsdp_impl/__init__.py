"""A minimal, readable reference implementation of Fully Sharded Data Parallel.

Mirrors ``torch.distributed.fsdp`` for what it supports, so swapping the import
works: ``from fsdp_impl import FullyShardedDataParallel as FSDP``.
"""

from fsdp_impl import wrap
from fsdp_impl.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType
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
    "wrap",
]
