"""Public enums and config dataclasses, spelled as ``torch.distributed.fsdp`` spells them.

Only the members this reference implements exist, so a user who swaps the import
gets an ``AttributeError`` instead of a silently ignored option. The wrapper's
options (FSDP1) come first, then ``fully_shard``'s policies (FSDP2).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "StateDictType",
    "OptimStateKeyType",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
    "CPUOffload",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "TrainingState",
    "ShardedState",
    "RESHARD_AFTER_FORWARD",
    "HYBRID_STRATEGIES",
]


class ShardingStrategy(enum.Enum):
    """How a unit's parameters, gradients and optimizer state are partitioned."""

    FULL_SHARD = enum.auto()
    """Shard params, grads and optimizer state; free full params after forward and backward."""
    SHARD_GRAD_OP = enum.auto()
    """Like FULL_SHARD but keep full params from forward until the end of backward."""
    NO_SHARD = enum.auto()
    """Replicate everything (DDP); gradients are all-reduced."""
    HYBRID_SHARD = enum.auto()
    """FULL_SHARD within the shard group, replicate across the replicate group."""
    _HYBRID_SHARD_ZERO2 = enum.auto()
    """SHARD_GRAD_OP within the shard group, replicate across the replicate group."""


#: Strategies that free the unsharded parameter after a (non-root) unit's forward.
RESHARD_AFTER_FORWARD = frozenset({ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD})
#: Strategies that use a (shard, replicate) pair of groups.
HYBRID_STRATEGIES = frozenset({ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2})


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward.

    Both orders follow the reverse of the recorded forward order.
    """

    BACKWARD_PRE = enum.auto()
    """Before the current unit's gradient computation (most overlap, most memory)."""
    BACKWARD_POST = enum.auto()
    """After the current unit's gradient computation, before its reduce-scatter is awaited."""


class StateDictType(enum.Enum):
    """Which layout ``state_dict()`` / ``load_state_dict()`` use inside ``state_dict_type``."""

    FULL_STATE_DICT = enum.auto()
    """Unflattened, unpadded original parameters on every rank, keyed as the unwrapped module."""
    SHARDED_STATE_DICT = enum.auto()
    """Each original parameter's local piece plus the metadata to place it (see state_dict.py)."""
    LOCAL_STATE_DICT = enum.auto()
    """Each unit's local flat shard as it is held (padding included), for a model of the same layout."""


class OptimStateKeyType(enum.Enum):
    """What ``rekey_optim_state_dict`` keys an optimizer state dict's parameters by."""

    PARAM_NAME = enum.auto()
    """The unwrapped module's parameter names (what the wrapper's optimizer state dicts use)."""
    PARAM_ID = enum.auto()
    """Positions in the optimizer's parameter order (what ``torch.optim.Optimizer.state_dict`` uses)."""


@dataclass
class StateDictConfig:
    """Options of ``state_dict()``; ``offload_to_cpu``: its tensors are moved to the CPU."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """FULL_STATE_DICT's options; ``rank0_only``: ranks other than 0 get an empty dict."""

    rank0_only: bool = False


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """SHARDED_STATE_DICT's options."""


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """LOCAL_STATE_DICT's options."""


@dataclass
class OptimStateDictConfig:
    """Options of ``optim_state_dict()``; ``offload_to_cpu``: its tensors are moved to the CPU."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """FULL_STATE_DICT's optimizer options; ``rank0_only``: ranks other than 0 get an empty dict."""

    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """SHARDED_STATE_DICT's optimizer options."""


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """LOCAL_STATE_DICT's optimizer options (the state in SHARDED's form); not offloaded by default."""

    offload_to_cpu: bool = False


@dataclass
class StateDictSettings:
    """A state-dict type with its model and optimizer options, as ``set_state_dict_type`` takes them."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


@dataclass(frozen=True)
class CPUOffload:
    """Keep flat parameter shards and their gradients on CPU between uses."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes a unit computes, communicates and keeps gradients in (``None``: unchanged).

    ``param_dtype``: the unsharded parameter, so all-gathers, forward and
    backward run in it (the sharded parameter stays in its own dtype).
    ``reduce_dtype``: gradient reduction (``None``: ``param_dtype``).
    ``buffer_dtype``: the root casts every buffer to it before forward.
    ``keep_low_precision_grads``: hand the optimizer gradients in the dtype they
    were reduced in instead of the sharded parameter's dtype.
    ``cast_forward_inputs``: every unit casts its floating inputs to its
    ``param_dtype``; ``cast_root_forward_inputs``: the root does.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``fully_shard``'s mixed precision (``None``: unchanged).

    ``param_dtype``: all-gather, forward and backward (the sharded parameter
    keeps its dtype); ``reduce_dtype``: gradient reduction (``None``:
    ``param_dtype``), and gradients accumulated without synchronizing;
    ``output_dtype``: floating outputs of the module's forward;
    ``cast_forward_inputs``: cast floating forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """``fully_shard``'s default: no offloading."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and their gradients on the CPU; compute on the mesh's device.

    ``pin_memory``: page-locked host memory, used when the mesh is on an accelerator.
    """

    pin_memory: bool = True


class TrainingState(enum.Enum):
    """What a unit is doing right now; guards hooks against running in the wrong phase."""

    IDLE = enum.auto()
    """Between iterations, or in forward before this unit ran."""
    FORWARD = enum.auto()
    """Inside this unit's forward."""
    BACKWARD_PRE = enum.auto()
    """Gradients reached this unit's outputs; its parameters are (being) unsharded."""
    BACKWARD_POST = enum.auto()
    """This unit's gradient was accumulated and its reduction issued."""
    SUMMON_FULL_PARAMS = enum.auto()
    """Inside ``summon_full_params``; forward/backward are not allowed."""


class ShardedState(enum.Enum):
    """Whether a unit's full (unsharded) parameter storage is allocated."""

    SHARDED = enum.auto()
    """Only the local shard exists; the unsharded storage has size 0."""
    UNSHARDING = enum.auto()
    """An all-gather into the unsharded storage was issued but not yet awaited."""
    UNSHARDED = enum.auto()
    """The unsharded storage holds the full parameter."""
