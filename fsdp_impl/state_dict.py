"""Model state dicts (FULL / SHARDED / LOCAL) and optimizer state dicts.

[Note: state dict formats]
Keys are always the unwrapped module's names (``_fsdp_wrapped_module.`` removed,
no ``_flat_param``), for both ``use_orig_params`` settings.

* FULL_STATE_DICT: every original parameter unflattened and unpadded, plus
  persistent buffers, on every rank (cloned: safe to keep after the call).
* SHARDED_STATE_DICT: each managed parameter's value is this rank's 1-D piece of
  the flattened parameter (exactly what ``use_orig_params=True`` exposes while
  sharded; full shape for a shard group of one); buffers and unmanaged
  parameters are full. The layout metadata is the model itself: load into a
  model wrapped the same way on the same world, and ``load_state_dict`` rejects
  mismatched pieces by shape.
* LOCAL_STATE_DICT: each unit's local flat shard as held (padding included) under
  ``<unit>._flat_param``, buffers and unmanaged parameters as SHARDED gives them; it
  loads into a model of the same layout. Its optimizer state dict is SHARDED's.
* ``optim_state_dict`` keys ``state`` by parameter name (FULL: per-parameter
  tensors in the parameter's shape; SHARDED: local pieces) and lists names in
  ``param_groups[i]["params"]``. ``optim_state_dict_to_load`` converts back to
  ``optim.load_state_dict``'s format for this model's optimizer.

The options of the units' settings ([Note: state dict settings]) apply to what a save returns:
``offload_to_cpu`` moves its tensors to the CPU, a FULL config's ``rank0_only`` leaves ranks other than
0 an empty dict.

Both model directions work by temporarily registering the original parameters
with ``.data`` pointing at full views (FULL) or local pieces (SHARDED) and then
using ``nn.Module.state_dict`` / ``load_state_dict`` unchanged, so buffers,
ignored modules and non-persistent buffers behave exactly as for a plain module.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
import torch.nn as nn

from fsdp_impl import collectives, summon
from fsdp_impl.api import StateDictSettings, StateDictType
from fsdp_impl.flat_param import FLAT_PARAM_NAME, FlatParamHandle
from fsdp_impl.layout import ParamSlot
from fsdp_impl.unit_state import UnitState, default_state_dict_settings, unit_state, unit_states

__all__ = [
    "model_state_dict",
    "load_model_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "optim_state_in",
    "load_form",
    "to_cpu",
    "clean_fqn",
]

_WRAPPED = re.compile(r"_fsdp_wrapped_module\.")


def clean_fqn(name: str) -> str:
    """``name`` as the unwrapped module spells it."""
    return _WRAPPED.sub("", name)


def _settings(root: nn.Module) -> StateDictSettings:
    """The state-dict settings of the first unit in ``root``'s tree (the defaults when there is none)."""
    units = unit_states(root)
    return units[0].state_dict_settings if units else default_state_dict_settings()


def _is_full(root: nn.Module) -> bool:
    return _settings(root).state_dict_type is StateDictType.FULL_STATE_DICT


def _is_local(root: nn.Module) -> bool:
    return _settings(root).state_dict_type is StateDictType.LOCAL_STATE_DICT


def _as_configured(state: dict[str, Any], offload_to_cpu: bool, rank0_only: bool) -> dict[str, Any]:
    """``state`` as its options ask: empty on ranks other than 0 with ``rank0_only``, every tensor on the
    CPU with ``offload_to_cpu``."""
    if rank0_only and collectives.group_rank(None) != 0:
        return {}
    return to_cpu(state) if offload_to_cpu else state


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts and lists) moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value


# -- model state dicts --------------------------------------------------------------------------
def model_state_dict(root: nn.Module) -> dict[str, Any]:
    """``root``'s state dict in the layout its units were told to use (see [Note: state dict formats])."""
    units = summon.managing_units(root)

    built = _buffer_dtypes(root)

    def snapshot(skip: frozenset[int] = frozenset()) -> dict[str, Any]:
        # Cloned inside the context: full views die with the unsharded storage. Buffers go out in
        # the dtype they were built in: a buffer_dtype casts them for compute, and FSDP1 documents
        # that checkpoints hold them "in full precision". They are found by identity, since state
        # dict hooks (an activation-checkpoint wrapper's) may rename them. ``skip``: ids left out.
        raw = nn.Module.state_dict(root, keep_vars=True)
        return {
            clean_fqn(k): (v.detach().to(built.get(id(v), v.dtype), copy=True)
                           if isinstance(v, torch.Tensor) else v)
            for k, v in raw.items() if id(v) not in skip
        }

    config = _settings(root).state_dict_config
    if _is_full(root):
        with summon.summon_full_params(root, writeback=False):
            state = snapshot()
        return _as_configured(state, config.offload_to_cpu, getattr(config, "rank0_only", False))
    summon.check_idle(units)
    for unit in units:
        summon.register_orig(unit, full=False)
    try:
        state = _with_flat_shards(root, units, snapshot(_managed_ids(units))) if _is_local(root) else snapshot()
        return _as_configured(state, config.offload_to_cpu, rank0_only=False)
    finally:
        for unit in units:
            summon.unregister_orig(unit)


def _buffer_dtypes(root: nn.Module) -> dict[int, torch.dtype]:
    """``id`` of each of the root's buffers -> the dtype it was built in (empty before the first
    forward, when no buffer has been cast yet)."""
    unit = unit_state(root)
    shared = None if unit is None else unit.root
    if shared is None:
        return {}
    built, top = shared.buffer_dtypes, next(u for u in shared.units if u.is_root).module
    return {id(buf): built[name] for name, buf in top.named_buffers() if name in built}


def load_model_state_dict(root: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> Any:
    """Load the output of :func:`model_state_dict` for the same layout."""
    units = summon.managing_units(root)
    full = _is_full(root)
    context = summon.summon_full_params(root, writeback=True) if full else contextlib.nullcontext()
    with context:
        if not full:
            summon.check_idle(units)
            for unit in units:
                summon.register_orig(unit, full=False)
        try:
            if _is_local(root):
                state_dict = _from_flat_shards(root, units, state_dict)
            names = {clean_fqn(k): k for k in nn.Module.state_dict(root, keep_vars=True)}
            remapped = {names.get(k, k): v for k, v in state_dict.items()}
            return nn.Module.load_state_dict(root, remapped, strict=strict)
        finally:
            if not full:
                for unit in units:
                    summon.unregister_orig(unit)


def _managed_ids(units: list[UnitState]) -> frozenset[int]:
    return frozenset(id(slot.param) for unit in units if unit.handle is not None for slot in unit.handle.slots)


def _flat_key(root: nn.Module, unit: UnitState) -> str:
    """``<unit>._flat_param``: where a LOCAL state dict keeps ``unit``'s flat shard."""
    name = next(n for n, m in root.named_modules() if m is unit.module)
    return clean_fqn(f"{name}.{FLAT_PARAM_NAME}" if name else FLAT_PARAM_NAME)


def _with_flat_shards(root: nn.Module, units: list[UnitState], state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (without the managed parameters) with every unit's local flat shard, cloned."""
    flats = {_flat_key(root, u): u.handle.flat_param.detach().clone() for u in units if u.handle is not None}
    return {**state, **flats}


def _from_flat_shards(root: nn.Module, units: list[UnitState], state: dict[str, Any]) -> dict[str, Any]:
    """A LOCAL ``state`` in SHARDED's form: each flat shard as the local pieces of its unit's parameters
    (called with the original parameters registered over their pieces); a unit's missing shard is left
    for a strict load to report as its parameters."""
    raw, out = nn.Module.state_dict(root, keep_vars=True), dict(state)
    for unit in units:
        handle = unit.handle
        flat = None if handle is None else out.pop(_flat_key(root, unit), None)
        if handle is None or flat is None:
            continue
        slots = {id(slot.param): slot for slot in handle.slots}
        out.update({clean_fqn(k): handle.sharded_view(slots[id(v)], flat) for k, v in raw.items() if id(v) in slots})
    return out


# -- optimizer state dicts ----------------------------------------------------------------------
def _param_slots(
    model: nn.Module,
) -> dict[int, list[tuple[str, FlatParamHandle | None, ParamSlot | None]]]:
    """id(optimizer-visible param) -> the (name, handle, slot)s it stands for."""
    out: dict[int, list[tuple[str, FlatParamHandle | None, ParamSlot | None]]] = {}
    managed: set[int] = set()
    for prefix, module in model.named_modules():
        unit = unit_state(module)
        handle = None if unit is None else unit.handle
        if handle is None:
            continue
        base = clean_fqn(f"{prefix}.") if prefix else ""
        entries: list[tuple[str, FlatParamHandle | None, ParamSlot | None]] = [
            (f"{base}{slot.fqn}", handle, slot) for slot in handle.slots
        ]
        if handle.use_orig_params:
            for slot, entry in zip(handle.slots, entries, strict=True):
                out[id(slot.param)] = [entry]
        else:
            out[id(handle.flat_param)] = entries
        managed.update(id(slot.param) for slot in handle.slots)
        managed.add(id(handle.flat_param))
    for name, param in model.named_parameters():
        if id(param) not in managed and id(param) not in out:
            out[id(param)] = [(clean_fqn(name), None, None)]
    return out


def _piece(
    handle: FlatParamHandle, slot: ParamSlot, shard_state: torch.Tensor, full: bool
) -> torch.Tensor:
    if not full:
        return handle.sharded_view(slot, shard_state).clone()
    gathered = summon.gather_shard_sized(handle, shard_state)
    return gathered[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()


def _as_shard(handle: FlatParamHandle, slot: ParamSlot, value: torch.Tensor) -> torch.Tensor:
    """A per-slot piece (orig mode) placed into a zero shard-sized tensor."""
    out = torch.zeros(handle.shard_numel, dtype=value.dtype, device=value.device)
    lo, hi = handle.local_range(slot)
    out[lo:hi] = value.reshape(-1)
    return out


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state in the layout and with the options ``model``'s units were told to use."""
    config = _settings(model).optim_state_dict_config
    state = optim_state_in(model, optim, full=_is_full(model))
    return _as_configured(state, config.offload_to_cpu, getattr(config, "rank0_only", False))


def optim_state_in(model: nn.Module, optim: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
    """The optimizer state keyed by parameter names: full tensors (``full``) or this rank's pieces."""
    slots = _param_slots(model)
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optim.param_groups:
        names: list[str] = []
        for param in group["params"]:
            entries = slots[id(param)]
            names.extend(name for name, _, _ in entries)
            param_state = optim.state.get(param, {})
            for name, handle, slot in entries:
                if not param_state:
                    continue
                state[name] = {}
                for key, value in param_state.items():
                    if handle is None or slot is None or not _is_shard_state(value, param):
                        state[name][key] = (
                            value.clone() if isinstance(value, torch.Tensor) else value
                        )
                        continue
                    shard_state = (
                        value if not handle.use_orig_params else _as_shard(handle, slot, value)
                    )
                    state[name][key] = _piece(handle, slot, shard_state, full)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def _is_shard_state(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def optim_state_dict_to_load(
    model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]
) -> dict[str, Any]:
    """``osd``, saved in the layout ``model``'s units were told to use, as ``optim.load_state_dict`` takes it."""
    return load_form(model, optim.param_groups, osd, full=_is_full(model))


def load_form(
    model: nn.Module, param_groups: list[dict[str, Any]], osd: dict[str, Any], full: bool
) -> dict[str, Any]:
    """``osd``, keyed by parameter names and holding full tensors (``full``) or this rank's pieces, as
    ``load_state_dict`` takes it for an optimizer over ``param_groups``."""
    slots = _param_slots(model)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group, saved_group in zip(param_groups, osd["param_groups"], strict=True):
        ids = []
        for param in group["params"]:
            entries = slots[id(param)]
            loaded = _load_param_state(param, entries, osd["state"], full)
            if loaded:
                state[index] = loaded
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _load_param_state(
    param: torch.Tensor,
    entries: list[tuple[str, FlatParamHandle | None, ParamSlot | None]],
    saved: dict[str, dict[str, Any]],
    full: bool,
) -> dict[str, Any]:
    """One optimizer-visible parameter's state rebuilt from per-name saved state."""
    present = [(name, h, s) for name, h, s in entries if name in saved]
    if not present:
        return {}
    first_name, handle, first_slot = present[0]
    if handle is None or first_slot is None:  # not managed by a unit: stored as-is
        return {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved[first_name].items()
        }
    out: dict[str, Any] = {}
    for key, value in saved[first_name].items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        shard = torch.zeros(handle.shard_numel, dtype=value.dtype, device=param.device)
        for name, _, slot in present:
            assert slot is not None
            lo, hi = handle.local_range(slot)
            tensor = saved[name][key].to(param.device).reshape(-1)
            if full:  # the full per-parameter tensor: take this rank's range of it
                start = handle.shard_rank * handle.shard_numel + lo - slot.offset
                tensor = tensor[start : start + hi - lo]
            shard[lo:hi] = tensor
        out[key] = (
            handle.sharded_view(first_slot, shard).clone() if handle.use_orig_params else shard
        )
    return out
