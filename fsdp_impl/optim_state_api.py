"""FSDP1's older optimizer state-dict functions: full and sharded saves, their loads, and re-keying.

[Note: older optimizer state dicts]
They read and write the forms of [Note: state dict formats] without consulting the units' state-dict
settings: each names its layout.

* ``full_optim_state_dict``: the full form (every rank takes part in the gathers); with ``rank0_only``
  ranks other than rank 0 of ``group`` get an empty dict.
* ``sharded_optim_state_dict``: this rank's pieces.
* ``shard_full_optim_state_dict`` / ``flatten_sharded_optim_state_dict``: a full / sharded form as
  ``optim.load_state_dict`` takes it for this model's optimizer (no communication for the full form).
* ``scatter_full_optim_state_dict``: rank 0 of ``group`` holds the full form; it is broadcast, then
  sharded as above.
* ``rekey_optim_state_dict``: keys by parameter name or by position in the optimizer's parameter order
  (``model.parameters()``'s without an optimizer), the state and each group's ``params`` alike.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import collectives
from fsdp_impl import state_dict as sd
from fsdp_impl.api import OptimStateKeyType

__all__ = [
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
    "rekey_optim_state_dict",
]


def full_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """The full form; empty on ranks other than ``group``'s rank 0 with ``rank0_only``."""
    state = sd.optim_state_in(model, optim, full=True)
    return {} if rank0_only and collectives.group_rank(group) != 0 else state


def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's pieces, keyed by parameter names."""
    return sd.optim_state_in(model, optim, full=False)


def _param_groups(model: nn.Module, optim: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    return [{"params": list(model.parameters())}] if optim is None else optim.param_groups


def shard_full_optim_state_dict(
    full_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """The full form as ``optim.load_state_dict`` takes it, this rank's share only."""
    return sd.load_form(model, _param_groups(model, optim), full_osd, full=True)


def flatten_sharded_optim_state_dict(
    sharded_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """This rank's pieces as ``optim.load_state_dict`` takes them."""
    return sd.load_form(model, optim.param_groups, sharded_osd, full=False)


def scatter_full_optim_state_dict(
    full_osd: dict[str, Any] | None,
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Rank 0 of ``group``'s full form, broadcast, as ``optim.load_state_dict`` takes it on each rank."""
    held = [sd.to_cpu(full_osd) if collectives.group_rank(group) == 0 else None]
    dist.broadcast_object_list(held, group=group, group_src=0)
    if held[0] is None:
        raise ValueError("scatter_full_optim_state_dict: rank 0 holds no full optimizer state dict")
    return shard_full_optim_state_dict(held[0], model, optim)


def rekey_optim_state_dict(
    osd: dict[str, Any], key_type: OptimStateKeyType, model: nn.Module, optim: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """``osd`` keyed by ``key_type``; ``osd`` itself when its keys already are."""
    names = [sd.clean_fqn(name) for name, _ in _named_in_order(model, optim)]
    by_name = key_type is OptimStateKeyType.PARAM_NAME
    mapping: dict[Any, Any] = dict(enumerate(names)) if by_name else {n: i for i, n in enumerate(names)}
    keys = list(osd["state"])
    kinds = {type(key) for key in keys}
    if len(kinds) > 1 or not kinds <= {str, int}:
        raise ValueError(f"Invalid parameter keys: {keys}")
    if kinds == {str if by_name else int}:
        return osd
    groups = copy.deepcopy(osd["param_groups"])
    for group in groups:
        group["params"] = sorted(mapping[key] for key in group["params"])
    return {"state": {mapping[key]: value for key, value in osd["state"].items()}, "param_groups": groups}


def _named_in_order(model: nn.Module, optim: torch.optim.Optimizer | None) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` in the optimizer's parameter order (``model.parameters()``'s without one)."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    params = (list(model.parameters()) if optim is None
              else [param for group in optim.param_groups for param in group["params"]])
    return [(name_of[id(param)], param) for param in params]
