"""The state-dict type and options each unit holds: what ``set_state_dict_type`` sets and
``get_state_dict_type`` reads.

[Note: state dict settings]
Every unit holds a :class:`~fsdp_impl.api.StateDictSettings` (FULL_STATE_DICT with default options until
told otherwise). ``set_state_dict_type`` gives every unit in a tree the same settings, filling an option
not given with its type's default and refusing an option of another type's class, and returns the
settings the tree held before; ``state_dict()``, ``load_state_dict()``, ``optim_state_dict()`` and
``optim_state_dict_to_load()`` read the root's. The options' effects (offloading to the CPU, only rank 0
keeping a full state dict) apply in :mod:`fsdp_impl.state_dict`.
"""

from __future__ import annotations

from fsdp_impl.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_impl.unit_state import UnitState

__all__ = ["settings_for", "settings_of", "set_settings"]

#: A state-dict type -> the classes of its model and optimizer options.
CONFIG_CLASSES: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def settings_for(
    kind: StateDictType, config: StateDictConfig | None, optim_config: OptimStateDictConfig | None
) -> StateDictSettings:
    """``kind`` with ``config`` and ``optim_config`` (``None``: the type's defaults); a ``RuntimeError``
    names an option of another type's class."""
    if kind not in CONFIG_CLASSES:
        raise NotImplementedError(f"state dict type {kind} is not supported")
    config_cls, optim_config_cls = CONFIG_CLASSES[kind]
    config = config_cls() if config is None else config
    optim_config = optim_config_cls() if optim_config is None else optim_config
    for expected, given in ((config_cls, config), (optim_config_cls, optim_config)):
        if type(given) is not expected:
            raise RuntimeError(f"Expected a config of type {expected} for {kind}, but got {type(given)}")
    return StateDictSettings(kind, config, optim_config)


def settings_of(units: list[UnitState]) -> StateDictSettings | None:
    """The settings ``units`` share (``None`` without units); an ``AssertionError`` when they differ."""
    if not units:
        return None
    first = units[0].state_dict_settings
    differing = [u.fqn_prefix or "<root>" for u in units if u.state_dict_settings != first]
    if differing:
        raise AssertionError(f"All FSDP modules must have the same state dict settings; {differing} differ")
    return first


def set_settings(units: list[UnitState], settings: StateDictSettings) -> None:
    """Give every unit of ``units`` ``settings``."""
    for unit in units:
        unit.state_dict_settings = settings
