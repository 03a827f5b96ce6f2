"""``fully_shard``: torch FSDP2's per-module front door onto the same units as the wrapper.

[Note: two front doors]
``FullyShardedDataParallel`` (FSDP1's shape) and :func:`fully_shard` (FSDP2's)
build the same :class:`~fsdp_impl.unit_state.UnitState` and run the same
lifecycle (``unit.py``): one flat parameter per unit, gathered and
reduce-scattered in one collective each, the same hooks, prefetch, reductions
and final callback. They differ in what the user sees:

* the wrapper puts a unit module around the user's; ``fully_shard`` swaps the
  module's class for ``FSDP<Class>`` (also an :class:`FSDPModule`) and registers
  the unit's pre/post-forward as forward hooks, so names and state-dict keys
  stay the plain model's;
* ``fully_shard`` lays the flat tensor out PER_PARAMETER ([Note: shard layouts]
  in ``layout.py``): a rank's piece of each parameter is whole rows,
  ``torch.chunk(param, shard_size)[rank]``, which is exactly the local tensor of
  a ``Shard(0)`` DTensor. Each original parameter is replaced by an
  ``nn.Parameter`` DTensor whose local tensor *is* that piece of the local shard
  (a view), and its ``.grad`` is a DTensor over the matching piece of the
  sharded gradient. These stay registered while the unit is unsharded (its
  forward computes on the unsharded views set as instance attributes, which
  attribute lookup finds first), so ``parameters()`` and ``state_dict()`` are
  always the sharded DTensors; torch registers the unsharded tensors there.

Why views of the unit's flat shard, not per-parameter storage: one storage per
unit keeps one all-gather input, one reduce-scatter output and one lifecycle for
both doors, and the optimizer's in-place update of a DTensor writes its local
tensor, i.e. the very shard the next all-gather reads. The cost is a copy
between the all-gather's rank-major output and the parameter-major flat tensor
when a unit has several parameters (FSDP2 pays the same copy-in/copy-out). The
DTensors are only what the user holds: every collective of the core is still
issued on ``torch.distributed`` at call time ([Note: collectives are looked up
at call time]), never through DTensor redistribution. When something replaces a
parameter's local tensor (``to_empty``/``.to``, which go through
``nn.Module._apply``; ``param.data = ...``) the shard is refilled from it and the
parameter views its piece again; ``load_state_dict(..., assign=True)``, which
replaces the parameter objects themselves, makes the new ones the unit's first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_impl import init, unit
from fsdp_impl.api import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from fsdp_impl.construct import check_type
from fsdp_impl.flat_param import FlatParamHandle
from fsdp_impl.fsdp_module import FSDPModule
from fsdp_impl.layout import MeshSharding
from fsdp_impl.unit_state import STATE_ATTR, UnitConfig, UnitControls, UnitGroups, UnitState, is_unit, unit_state

__all__ = ["fully_shard"]

#: Original class -> its ``FSDP<Class>``, made once per class.
_FSDP_CLASSES: dict[type, type] = {}
#: An original parameter's identity, kept on the DTensor parameter that replaces it (tags come from _ORIGINS).
_ORIGIN_ATTR = "_fsdp_impl_origin"
_ORIGINS = itertools.count()


def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, as torch's default
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, as torch's default
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters not yet owned by a ``fully_shard``-ed submodule (call it
    bottom-up, the root last); returns ``module``, now also an :class:`FSDPModule`.

    ``mesh``: 1-D shards over it, 2-D ``(replicate, shard)`` is HSDP (default: the
    whole world on the accelerator, else the CPU). ``reshard_after_forward``:
    ``True`` frees the unsharded parameters after forward, ``False`` keeps them
    for backward, ``None`` is ``True`` except for the root, an int ``k`` (a
    factor of the shard size) keeps each rank's share of them for an all-gather
    over ``k`` consecutive ranks in backward ([Note: unit lifecycle]).
    """
    _check_module(module)
    check_type("mp_policy", mp_policy, MixedPrecisionPolicy, allow_none=False)
    check_type("offload_policy", offload_policy, OffloadPolicy, allow_none=False)
    mesh = mesh if mesh is not None else _default_mesh()
    groups, strategy, sharding = _mesh_groups(mesh)
    setting, groups.post_forward_group = _reshard_setting(reshard_after_forward, groups, mesh)
    device = _mesh_device(mesh)
    params, buffers = _managed(module, ignored_params)
    _move(params, buffers, device)
    config = _config(strategy, mp_policy, offload_policy)
    handle = _build_handle(params, device, groups, config, sharding) if params else None
    _check_not_shared(module, handle)
    module.__dict__[STATE_ATTR] = UnitState(module, config, groups, device, handle, UnitControls(setting))
    module.register_forward_pre_hook(unit.pre_forward_hook, prepend=True, with_kwargs=True)
    module.register_forward_hook(unit.post_forward_hook, with_kwargs=True)
    module.register_load_state_dict_post_hook(_adopt_loaded_params)
    cls = type(module)
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES.setdefault(cls, type(f"FSDP{cls.__name__}", (FSDPModule, cls), {}))
    module.__class__ = _FSDP_CLASSES[cls]
    return module


def _adopt_loaded_params(module: nn.Module, incompatible_keys: Any) -> None:
    """After ``load_state_dict(..., assign=True)``: the parameters it put on the unit's modules become the unit's
    sharded parameters, and its shard is refilled from them, as after ``_apply``."""
    state = unit_state(module)
    if state is not None and state.handle is not None and _adopt_registered(state.handle):
        state.handle.follow_moved_params()


def _adopt_registered(handle: FlatParamHandle) -> bool:
    """Take as each slot's parameter the one its first module now registers; whether any changed."""
    changed = False
    for slot in handle.slots:
        owner, name = slot.registrations[0]
        current = owner._parameters.get(name)
        if current is not None and current is not slot.param:
            slot.param, changed = current, True
    return changed


def _check_module(module: Any) -> None:
    check_type("module", module, nn.Module, allow_none=False)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement forward: {module}")
    if is_unit(module):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}: apply it once per module")


def _managed(
    module: nn.Module, ignored_params: Iterable[nn.Parameter] | None
) -> tuple[list[tuple[str, nn.Module, str, nn.Parameter]], list[tuple[nn.Module, str]]]:
    """The parameters (but ``ignored_params``) and buffers of ``module`` outside nested units."""
    ignored = {id(param) for param in ignored_params or ()}
    params, buffers = init.managed_tensors(module, set())
    params = [entry for entry in params if id(entry[3]) not in ignored]
    for fqn, _, _, param in params:
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor with numel equal to 1."
            )
    return params, buffers


def _build_handle(
    params: list[tuple[str, nn.Module, str, nn.Parameter]],
    device: torch.device,
    groups: UnitGroups,
    config: UnitConfig,
    sharding: MeshSharding,
) -> FlatParamHandle:
    """The unit's flat parameter; each DTensor parameter keeps its original's identity tag."""
    handle = FlatParamHandle(
        params,
        compute_device=device,
        offload_params=config.cpu_offload.offload_params,
        shard_group=groups.shard_group,
        shard_size=groups.shard_size,
        shard_rank=groups.shard_rank,
        use_orig_params=True,
        mixed_precision=config.mixed_precision,
        sharding=sharding,
    )
    originals = {id(param): param for _, _, _, param in params}.values()  # in the slots' order
    for slot, original in zip(handle.slots, originals, strict=True):
        if not hasattr(original, _ORIGIN_ATTR):
            setattr(original, _ORIGIN_ATTR, next(_ORIGINS))
        setattr(slot.param, _ORIGIN_ATTR, getattr(original, _ORIGIN_ATTR))
    return handle


def _check_not_shared(module: nn.Module, handle: FlatParamHandle | None) -> None:
    """A parameter that two units of ``module``'s tree (``handle`` its own) would manage raises the
    ValueError torch raises at the root's first forward (here: when the second unit joins a tree)."""
    seen: dict[int, str] = {}
    for prefix, sub in module.named_modules():
        state = unit_state(sub)
        owned = handle if sub is module else (None if state is None else state.handle)
        for slot in [] if owned is None else owned.slots:
            origin, fqn = getattr(slot.param, _ORIGIN_ATTR, None), f"{prefix}.{slot.fqn}".lstrip(".")
            if origin in seen:
                raise ValueError(
                    f"Parameter {fqn!r} is shared with a parameter already managed by another FSDP group "
                    f"({seen[origin]!r}). For shared/tied parameters, apply fully_shard to a common ancestor "
                    "of their modules only."
                )
            if origin is not None:
                seen[origin] = fqn


def _default_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_device(mesh: Any) -> torch.device:
    """Where units on ``mesh`` compute: the CPU, else the mesh type's current device."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def _mesh_groups(mesh: Any) -> tuple[UnitGroups, ShardingStrategy, MeshSharding]:
    """The groups, the equivalent wrapper strategy and the DTensor placements of a 1-D or 2-D mesh."""
    if getattr(mesh, "ndim", None) not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh!r}")
    flat = mesh.ndim == 1
    groups = init.Groups(mesh.get_group(0), None) if flat else init.Groups(mesh.get_group(1), mesh.get_group(0))
    strategy = ShardingStrategy.FULL_SHARD if flat else ShardingStrategy.HYBRID_SHARD
    placements: tuple[Placement, ...] = (Shard(0),) if flat else (Replicate(), Shard(0))
    return init.unit_groups(groups, strategy), strategy, MeshSharding(mesh, placements)


def _reshard_setting(value: Any, groups: UnitGroups, mesh: Any) -> tuple[bool | int | None, dist.ProcessGroup | None]:
    """``reshard_after_forward`` validated, and for a proper factor of the shard size the group of
    that many consecutive shard ranks this rank gathers over in backward (1 means False, the whole
    shard size True, as torch reads them)."""
    if value is None or isinstance(value, bool):
        return value, None
    size = groups.shard_size
    if not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward should be a bool or an int representing the group size to reshard to, not {value!r}"
        )
    if value < 1 or value > size or size % value:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {size}, not {value}")
    if value in (1, size):
        return value == size, None
    mine = None
    for ranks in mesh.mesh.reshape(-1, value).tolist():  # every rank creates every group, in order
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return int(value), mine


def _move(
    params: list[tuple[str, nn.Module, str, nn.Parameter]], buffers: list[tuple[nn.Module, str]], device: torch.device
) -> None:
    """Managed parameters and buffers to ``device``; meta tensors stay for ``to_empty`` later."""
    with torch.no_grad():
        for _, _, _, param in params:
            if not param.is_meta and param.device != device:
                param.data = param.data.to(device)
        for owner, name in buffers:
            buf = owner._buffers[name]
            if buf is not None and not buf.is_meta and buf.device != device:
                owner._buffers[name] = buf.to(device)


def _config(strategy: ShardingStrategy, mp: MixedPrecisionPolicy, offload: OffloadPolicy) -> UnitConfig:
    """FSDP2's settings in the core's terms ([Note: two front doors])."""
    precision = None
    if mp.param_dtype is not None or mp.reduce_dtype is not None:
        precision = MixedPrecision(
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            cast_forward_inputs=mp.cast_forward_inputs,
            cast_root_forward_inputs=False,
        )
    return UnitConfig(
        sharding_strategy=strategy,
        cpu_offload=CPUOffload(offload_params=isinstance(offload, CPUOffloadPolicy)),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=False,
        limit_all_gathers=False,
        use_orig_params=True,
        use_full_prec_in_eval=False,
        mixed_precision=precision,
        output_dtype=mp.output_dtype,
        reshard_without_grad=False,
        unsynced_in_reduce_dtype=True,
    )
