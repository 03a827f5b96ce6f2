"""Mutants of FSDP1's optimizer state-dict functions and state-dict settings (the ``legacy_state_dicts`` rows)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["FullOptimStateOnEveryRank", "FullOptimStateSharded", "LocalShardsNotLoaded", "OffloadKeepsDevice",
           "OffloadWithoutCopy", "RekeyKeepsKeys", "ShardedOptimLoadDropsState", "StateDictSettingsNotSet"]

Fn = Callable[..., Any]


def _ignoring_rank0_only(full: Fn) -> Fn:
    def full_on_every_rank(model: Any, optim: Any, rank0_only: bool, group: Any) -> Any:
        return full(model, optim, False, group)

    return full_on_every_rank


class FullOptimStateOnEveryRank(_Mutant):
    """``full_optim_state_dict(rank0_only=True)`` gives every rank the full state dict."""

    name = "mutant-full-optim-state-on-every-rank"
    breaks = "leaving ranks other than 0 an empty dict with rank0_only"
    expect = Expect("legacy_state_dicts and full_optim_state_dict", "thread",
                    ("legacy_state_dicts/full_optim_state_dict[rank0_only=True]",))
    patches = (Patch("fsdp_impl.optim_state_api:full_optim_state_dict", _ignoring_rank0_only),)


def _always_sharded(state_in: Fn) -> Fn:
    def state_in_sharded(model: Any, optim: Any, full: bool) -> Any:
        return state_in(model, optim, False)

    return state_in_sharded


class FullOptimStateSharded(_Mutant):
    """A full optimizer state dict holds this rank's pieces instead of the full tensors."""

    name = "mutant-full-optim-state-sharded"
    breaks = "gathering the full optimizer state"
    expect = Expect("legacy_state_dicts and (full_optim_state_dict or full_orig_params or load_full or settings)",
                    "thread", ("legacy_state_dicts/full_optim_state_dict", "legacy_state_dicts/full_orig_params",
                               "legacy_state_dicts/load_full", "legacy_state_dicts/settings[kind=FULL]"))
    patches = (Patch("fsdp_impl.state_dict:optim_state_in", _always_sharded),)


class RekeyKeepsKeys(_Mutant):
    """``rekey_optim_state_dict`` returns the state dict with the keys it had."""

    name = "mutant-rekey-keeps-keys"
    breaks = "re-keying an optimizer state dict by names or ids"
    expect = Expect("legacy_state_dicts and rekey", "thread", ("legacy_state_dicts/rekey",))
    patches = (Patch.instead("fsdp_impl.optim_state_api:rekey_optim_state_dict",
                             lambda osd, key_type, model, optim: osd),)


def _dropping_state(flatten: Fn) -> Fn:
    def flatten_dropping_state(sharded_osd: Any, model: Any, optim: Any) -> Any:
        return {**flatten(sharded_osd, model, optim), "state": {}}

    return flatten_dropping_state


class ShardedOptimLoadDropsState(_Mutant):
    """``flatten_sharded_optim_state_dict`` keeps the hyperparameters but drops the per-parameter state."""

    name = "mutant-sharded-optim-load-drops-state"
    breaks = "loading a sharded optimizer state dict's per-parameter state"
    expect = Expect("legacy_state_dicts and sharded_roundtrip", "thread", ("legacy_state_dicts/sharded_roundtrip",))
    patches = (Patch("fsdp_impl.optim_state_api:flatten_sharded_optim_state_dict", _dropping_state),)


class StateDictSettingsNotSet(_Mutant):
    """``set_state_dict_type`` (and the ``state_dict_type`` context) leaves the units' settings as they were."""

    name = "mutant-state-dict-settings-not-set"
    breaks = "setting the state-dict type and its options"
    expect = Expect("legacy_state_dicts and settings", "thread", ("legacy_state_dicts/settings",))
    patches = (Patch.instead("fsdp_impl.state_dict_settings:set_settings", lambda units, settings: None),)


def _zeros_on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value, device="cpu")
    if isinstance(value, dict):
        return {k: _zeros_on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_zeros_on_cpu(v) for v in value]
    return value


class OffloadWithoutCopy(_Mutant):
    """``offload_to_cpu`` allocates each value's CPU tensor and never copies into it."""

    name = "mutant-offload-without-copy"
    breaks = "the values of a state dict offloaded to the CPU"
    expect = Expect("legacy_state_dicts and offload", "thread", ("legacy_state_dicts/offload",))
    patches = (Patch.instead("fsdp_impl.state_dict:to_cpu", _zeros_on_cpu),)


class OffloadKeepsDevice(_Mutant):
    """``offload_to_cpu`` leaves every value where it was (only a GPU tells this from a correct offload)."""

    name = "mutant-offload-keeps-device"
    breaks = "moving an offloaded state dict's values to the CPU"
    expect = Expect("legacy_state_dicts and offload", "thread", ("legacy_state_dicts/offload",), accelerators=1)
    patches = (Patch.instead("fsdp_impl.state_dict:to_cpu", lambda value: value),)


def _flat_shards_dropped(root: Any, units: Any, state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if not key.endswith("_flat_param")}


class LocalShardsNotLoaded(_Mutant):
    """Loading a LOCAL state dict leaves the flat shards out: the units' parameters keep their values."""

    name = "mutant-local-shards-not-loaded"
    breaks = "loading a local state dict's flat shards"
    expect = Expect("legacy_state_dicts and (settings or offload) and LOCAL", "thread",
                    ("legacy_state_dicts/settings[kind=LOCAL]", "legacy_state_dicts/offload[kind=LOCAL]"))
    patches = (Patch.instead("fsdp_impl.state_dict:_from_flat_shards", _flat_shards_dropped),)
