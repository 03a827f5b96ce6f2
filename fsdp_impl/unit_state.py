"""What a unit is and everything it knows: the one way modules below the top class reach a unit.

[Note: unit state]
A unit is an ``nn.Module`` that carries a :class:`UnitState` (attribute
:data:`STATE_ATTR`). Modules below ``fully_sharded_data_parallel`` never import
``FullyShardedDataParallel``: they ask :func:`unit_state` ("is this a unit, and
what is its state?") and read or write the state's fields. The top class builds
the state in its constructor and exposes its public surface as properties over
it. Imports therefore point one way:

    api, collectives -> layout -> flat_param -> exec_order -> unit_state -> precision, init, wrap
        -> reduction -> unit -> no_sync, state_dict -> construct -> fully_sharded_data_parallel, composable

Settings the user gives the constructor or ``fully_shard`` live in
:class:`UnitConfig` (frozen; auto-wrapped children get the same ones), the ones
FSDP2's ``set_*`` methods change between iterations in :class:`UnitControls`,
groups in :class:`UnitGroups`, and per-iteration bookkeeping directly on
:class:`UnitState`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import collectives
from fsdp_impl.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
    TrainingState,
)
from fsdp_impl.exec_order import ExecOrderData
from fsdp_impl.flat_param import FlatParamHandle

__all__ = [
    "STATE_ATTR",
    "default_state_dict_settings",
    "UnitConfig",
    "UnitControls",
    "UnitGroups",
    "UnitState",
    "Reduction",
    "RootState",
    "unit_state",
    "is_unit",
    "named_unit_states",
    "unit_states",
]

#: The attribute of a unit module that holds its :class:`UnitState`.
STATE_ATTR = "_fsdp_state"


@dataclass(frozen=True)
class UnitConfig:
    """The unit's settings, fixed at construction (new per-unit options go here)."""

    sharding_strategy: ShardingStrategy  # effective: NO_SHARD when the data-parallel world is 1
    cpu_offload: CPUOffload  # keep the local shard (and its gradient) on the CPU between uses
    backward_prefetch: BackwardPrefetch | None  # when to issue the next backward unit's all-gather
    forward_prefetch: bool  # issue the next forward unit's all-gather before computing this one
    limit_all_gathers: bool  # bound prefetched-but-unused all-gathers (see [Note: limit_all_gathers])
    use_orig_params: bool  # keep the original parameters registered (views of the flat shard)
    use_full_prec_in_eval: bool  # FSDP_USE_FULL_PREC_IN_EVAL=1 at construction; must agree across units
    mixed_precision: MixedPrecision | None = None  # compute/communication dtypes (see [Note: mixed precision])
    output_dtype: torch.dtype | None = None  # fully_shard: floating forward outputs are cast to it
    reshard_without_grad: bool = True  # the wrapper frees after a forward no backward can follow
    unsynced_in_reduce_dtype: bool = False  # fully_shard: gradients kept unsynchronized add up in reduce_dtype

    def low_precision(self, training: bool) -> MixedPrecision | None:
        """The mixed-precision policy in force for a forward in this mode (None: full precision)."""
        if self.mixed_precision is None or (self.use_full_prec_in_eval and not training):
            return None
        return self.mixed_precision


@dataclass
class UnitControls:
    """What a unit does around forward and backward, changeable between iterations (FSDP2's
    ``set_*`` methods; the wrapper's ``no_sync()`` flips ``requires_gradient_sync``)."""

    reshard_after_forward: bool | int | None  # None: unless root; int: to the post-forward group (UnitGroups)
    reshard_after_backward: bool = True  # free the unsharded parameter after its gradient is reduced
    requires_gradient_sync: bool = True  # False: backward keeps the unsharded gradient ([Note: no_sync])
    forward_prefetch: list[UnitState] | None = None  # all-gathers issued after this unit's (None: recorded order)
    backward_prefetch: list[UnitState] | None = None  # likewise in backward (None: BackwardPrefetch)
    gradient_divide_factor: float | None = None  # summed gradients are divided by it (None: dp_world_size)
    requires_all_reduce: bool = True  # False: keep the reduce-scattered sum for later ([Note: partial reduction])
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # run on the reduced piece before division
    unshard_in_backward: bool = True  # False: backward never all-gathers (its backward reads no parameter)
    is_last_backward: bool = True  # the root's: False, backward leaves its last reductions to the next one
    comm_hook: tuple[object, Callable[..., None]] | None = None  # (state, hook): reduces instead ([Note: comm hook])


@dataclass
class UnitGroups:
    """The process groups a unit talks over and the sizes derived from them."""

    process_group: dist.ProcessGroup | None  # the shard group as the user sees it (``process_group``)
    inter_node_pg: dist.ProcessGroup | None  # the replicate group for hybrid strategies, else None
    shard_group: dist.ProcessGroup | None  # all-gather / reduce-scatter group (None for NO_SHARD)
    replicate_group: dist.ProcessGroup | None  # gradients are all-reduced over it after reduce-scatter
    shard_size: int  # ranks the flat parameter is split over (1 for NO_SHARD)
    shard_rank: int  # this rank's index in the shard group
    dp_world_size: int  # shard x replicate size: summed gradients are divided by it
    post_forward_group: dist.ProcessGroup | None = None  # reshard_after_forward=<int>: gathered over in backward

    @property
    def replicate_size(self) -> int:
        """Size of the replicate group (1 when there is none)."""
        return 1 if self.replicate_group is None else collectives.group_size(self.replicate_group)


def default_state_dict_settings() -> StateDictSettings:
    """What a unit holds until told otherwise: a full state dict with default options."""
    return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


@dataclass(eq=False)  # units are told apart by identity (membership in lists, order checks)
class UnitState:
    """One unit: what it wraps, its settings and groups, and its per-iteration bookkeeping."""

    module: nn.Module  # the wrapped module (registered on the unit as ``_fsdp_wrapped_module``)
    config: UnitConfig
    groups: UnitGroups
    compute_device: torch.device  # where the unsharded parameter lives and compute runs
    handle: FlatParamHandle | None  # this unit's flat parameter; None when it manages no parameter
    controls: UnitControls
    is_root: bool | None = None  # set by lazy init at the first forward: no unit above it
    root: RootState | None = None  # shared with every unit under the same root, set by lazy init
    fqn_prefix: str = ""  # the unit's name under its root plus ".", for messages naming parameters
    ran_pre_backward: bool = False  # the pre-backward hook ran in this backward
    backward_task: int = -1  # autograd graph task of that hook (a nested backward has another)
    training_state: TrainingState = TrainingState.IDLE  # the phase the unit is in
    # the state-dict type and options (see [Note: state dict settings])
    state_dict_settings: StateDictSettings = field(default_factory=default_state_dict_settings)
    saved_flat_grad: torch.Tensor | None = None  # flat_param.grad set aside inside summon_full_params
    summoned: torch.Tensor | None = None  # the full parameters summon_full_params exposes (maybe a CPU copy)
    unsynced_grad: torch.Tensor | None = None  # unsharded gradient kept by backwards inside no_sync()
    partial_reduce: torch.Tensor | None = None  # reduce-scattered sum kept without all-reduce (hybrid)

    @property
    def training(self) -> bool:
        """Whether the wrapped module is in training mode."""
        return self.module.training


@dataclass
class Reduction:
    """One unit's gradient on its way from ``full.grad`` to the sharded gradient."""

    unit: UnitState
    pending: collectives.Pending | None
    stage: str  # "reduce_scatter" -> "all_reduce" -> "done"; "kept" (partial), "hooked" (comm hook)


@dataclass
class RootState:
    """State shared by all units under one root, reset at the end of each backward."""

    units: list[UnitState]
    exec_order: ExecOrderData[UnitState]
    reductions: list[Reduction] = field(default_factory=list)
    prefetched: list[UnitState] = field(default_factory=list)  # all-gathers issued ahead of use
    callback_queued: bool = False  # the end-of-backward callback is queued for this backward
    buffer_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # the root's buffers as built


def unit_state(module: nn.Module) -> UnitState | None:
    """``module``'s state if it is a unit, else None."""
    state = module.__dict__.get(STATE_ATTR)
    return state if isinstance(state, UnitState) else None


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is a unit of this implementation."""
    return unit_state(module) is not None


def named_unit_states(module: nn.Module) -> list[tuple[str, UnitState]]:
    """``(name, state)`` of every unit in ``module``'s tree (``module`` itself is ``""``), in order."""
    return [(name, state) for name, sub in module.named_modules() if (state := unit_state(sub)) is not None]


def unit_states(module: nn.Module) -> list[UnitState]:
    """The state of every unit in ``module``'s tree, in module order."""
    return [state for _, state in named_unit_states(module)]
