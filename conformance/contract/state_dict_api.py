"""FSDP1's state-dict functions (its static optimizer state-dict API and state-dict settings) as optional
adapter methods: the functions :mod:`conformance.contract.optional` exports (its table gives each default),
defined here by family.

Each calls the adapter's method of the same name and raises :class:`StateDictAPIUnsupported` when the
adapter has none, so the case is ``n/a``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import optional_method

__all__ = ["StateDictAPIUnsupported", "StateDictSettingsSpec", "flatten_sharded_optim_state_dict",
           "full_optim_state_dict", "get_state_dict_type", "load_optim_state_dict_as_set", "optim_state_dict_as_set",
           "rekey_optim_state_dict", "scatter_full_optim_state_dict", "set_state_dict_type",
           "shard_full_optim_state_dict", "sharded_optim_state_dict"]


@dataclass(frozen=True)
class StateDictSettingsSpec:
    """A state-dict type and its options, in FSDP1's terms (``set_state_dict_type``'s arguments).

    ``kind``: a ``StateDictType`` member's name (``FULL_STATE_DICT``, ``SHARDED_STATE_DICT``, or
    ``LOCAL_STATE_DICT`` where the adapter declares :attr:`Capability.LOCAL_STATE_DICT`);
    ``offload_to_cpu`` / ``rank0_only``: the model state dict's config (``rank0_only`` only for FULL);
    ``optim_offload_to_cpu`` / ``optim_rank0_only``: the optimizer state dict's, with torch's defaults.
    """

    kind: str
    offload_to_cpu: bool = False
    rank0_only: bool = False
    optim_offload_to_cpu: bool = True
    optim_rank0_only: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
            raise ValueError(f"kind must be FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT, got {self.kind!r}")
        if self.kind != "FULL_STATE_DICT" and (self.rank0_only or self.optim_rank0_only):
            raise ValueError("rank0_only is an option of FULL_STATE_DICT only")


class StateDictAPIUnsupported(NotImplementedError):
    """The adapter lacks one of FSDP1's state-dict functions or settings (cases report ``n/a``)."""


_state_dict_api = functools.partial(optional_method, StateDictAPIUnsupported)


def full_optim_state_dict(
    adapter: Any, model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool, group: Any = None
) -> dict[str, Any]:
    """The full optimizer state of the wrapped ``model``, keyed by parameter names as FSDP1's
    ``full_optim_state_dict(model, optim, rank0_only=..., group=...)`` returns it (collective; with
    ``rank0_only`` ranks other than 0 get ``{}``).

    Optional part of the contract (:attr:`Capability.OPTIM_STATE_DICT_FUNCTIONS`), as the five below. Each
    raises :class:`StateDictAPIUnsupported` when the adapter lacks the method.
    """
    return _state_dict_api(adapter, "full_optim_state_dict")(  # type: ignore[no-any-return]
        model, optim, rank0_only=rank0_only, group=group)


def sharded_optim_state_dict(adapter: Any, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's share of the optimizer state, keyed by parameter names (FSDP1's ``sharded_optim_state_dict``)."""
    return _state_dict_api(adapter, "sharded_optim_state_dict")(model, optim)  # type: ignore[no-any-return]


def shard_full_optim_state_dict(
    adapter: Any, full_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """``full_osd`` (a full optimizer state dict keyed by names) as ``optim.load_state_dict`` takes it for the
    wrapped ``model`` (FSDP1's ``shard_full_optim_state_dict(full_osd, model, optim=optim)``)."""
    return _state_dict_api(adapter, "shard_full_optim_state_dict")(  # type: ignore[no-any-return]
        full_osd, model, optim)


def scatter_full_optim_state_dict(
    adapter: Any, full_osd: dict[str, Any] | None, model: nn.Module, optim: torch.optim.Optimizer, *, group: Any = None
) -> dict[str, Any]:
    """Rank 0's ``full_osd`` (ignored on other ranks) as each rank's ``optim`` loads it (collective; FSDP1's
    ``scatter_full_optim_state_dict(full_osd, model, optim=optim, group=group)``)."""
    return _state_dict_api(adapter, "scatter_full_optim_state_dict")(  # type: ignore[no-any-return]
        full_osd, model, optim, group=group)


def flatten_sharded_optim_state_dict(
    adapter: Any, sharded_osd: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """What :func:`sharded_optim_state_dict` returned, as ``optim.load_state_dict`` takes it (FSDP1's
    ``flatten_sharded_optim_state_dict``)."""
    return _state_dict_api(adapter, "flatten_sharded_optim_state_dict")(  # type: ignore[no-any-return]
        sharded_osd, model, optim)


def rekey_optim_state_dict(
    adapter: Any, osd: dict[str, Any], key_type: str, model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """``osd`` keyed by parameter names (``key_type="PARAM_NAME"``) or by positions in ``optim``'s parameter
    order (``"PARAM_ID"``), for ``model`` and its ``optim`` (FSDP1's ``rekey_optim_state_dict`` with
    ``OptimStateKeyType``)."""
    if key_type not in ("PARAM_NAME", "PARAM_ID"):
        raise ValueError(f"key_type must be PARAM_NAME or PARAM_ID, got {key_type!r}")
    return _state_dict_api(adapter, "rekey_optim_state_dict")(  # type: ignore[no-any-return]
        osd, key_type, model, optim)


def set_state_dict_type(
    adapter: Any, model: nn.Module, settings: StateDictSettingsSpec
) -> StateDictSettingsSpec | None:
    """Give every unit of the wrapped ``model`` ``settings``; the settings they held before (FSDP1's
    ``set_state_dict_type``, whose ``StateDictSettings`` the adapter describes as a
    :class:`StateDictSettingsSpec`).

    Optional part of the contract (:attr:`Capability.STATE_DICT_SETTINGS`), as the two below. Each raises
    :class:`StateDictAPIUnsupported` when the adapter lacks the method.
    """
    return _state_dict_api(adapter, "set_state_dict_type")(model, settings)  # type: ignore[no-any-return]


def get_state_dict_type(adapter: Any, model: nn.Module) -> StateDictSettingsSpec | None:
    """The settings the units of ``model`` hold (FSDP1's ``get_state_dict_type``)."""
    return _state_dict_api(adapter, "get_state_dict_type")(model)  # type: ignore[no-any-return]


def optim_state_dict_as_set(adapter: Any, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state dict in the type and with the options :func:`set_state_dict_type` set (FSDP1's
    ``optim_state_dict(model, optim)`` with no ``state_dict_type`` context around it)."""
    return _state_dict_api(adapter, "optim_state_dict_as_set")(model, optim)  # type: ignore[no-any-return]


def load_optim_state_dict_as_set(
    adapter: Any, model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]
) -> None:
    """Load what :func:`optim_state_dict_as_set` returned into ``optim``, in the type and with the options
    :func:`set_state_dict_type` set (FSDP1's ``optim_state_dict_to_load`` with no context around it)."""
    _state_dict_api(adapter, "load_optim_state_dict_as_set")(model, optim, osd)
