"""Construction-time decisions: groups, devices, ignored modules, materialization, sync.

Everything here runs inside the constructor so that bad input fails there with a
message naming the value and what was expected, never later as a hang.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import collectives
from fsdp_impl.api import HYBRID_STRATEGIES, ShardingStrategy
from fsdp_impl.unit_state import UnitGroups, is_unit, unit_state

__all__ = [
    "Groups",
    "resolve_groups",
    "effective_strategy",
    "unit_groups",
    "check_not_shared_with_nested",
    "ranks_per_node",
    "collect_ignored",
    "resolve_device_id",
    "place_module",
    "sync_module_states",
    "managed_tensors",
]


class Groups(NamedTuple):
    """``shard`` all-gathers/reduce-scatters; ``replicate`` all-reduces grads (None: none)."""

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None

    def as_arg(self) -> Any:
        """What to pass nested units so they share exactly these groups."""
        return self.shard if self.replicate is None else (self.shard, self.replicate)


# -- process groups ----------------------------------------------------------------------------
def resolve_groups(
    process_group: Any,
    strategy: ShardingStrategy,
    device_mesh: Any,
    auto_wrapping: bool,
) -> Groups:
    """Map the user's ``process_group`` / ``device_mesh`` to (shard, replicate) groups."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass either process_group or device_mesh, not both")
    if strategy in HYBRID_STRATEGIES:
        return _hybrid_groups(process_group, strategy, device_mesh, auto_wrapping)
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(f"{strategy} expects a 1-D device_mesh, got ndim={device_mesh.ndim}")
        return Groups(device_mesh.get_group(0), None)
    if isinstance(process_group, tuple):
        raise ValueError(
            f"a (shard, replicate) process_group tuple needs a hybrid strategy, got {strategy}"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    return Groups(group, None)


def _hybrid_groups(
    process_group: Any, strategy: ShardingStrategy, mesh: Any, auto_wrapping: bool
) -> Groups:
    if process_group is None and mesh is None:
        if not auto_wrapping:
            raise ValueError(
                f"Manual wrapping with {strategy} "
                "requires explicit specification of process group or device_mesh."
            )
        return _auto_hybrid_groups(ranks_per_node())
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(
                f"{strategy} expects a 2-D (replicate, shard) device_mesh, got ndim={mesh.ndim}"
            )
        return Groups(mesh.get_group(1), mesh.get_group(0))
    if not (isinstance(process_group, tuple) and len(process_group) == 2):
        raise ValueError(
            "Expected process_group to be passed in as either None or "
            f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}"
        )
    shard, replicate = process_group
    s, r, w = (
        collectives.group_size(shard),
        collectives.group_size(replicate),
        dist.get_world_size(),
    )
    if s * r != w:
        raise ValueError(
            f"hybrid process_group sizes: shard({s}) * replicate({r}) != world_size({w})"
        )
    return Groups(shard, replicate)


def ranks_per_node() -> int:
    """``LOCAL_WORLD_SIZE`` if set, else the accelerator count, else the whole world (one host)."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env:
        return int(env)
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return dist.get_world_size()


def _auto_hybrid_groups(per_node: int) -> Groups:
    """Contiguous intra-node (shard) blocks and strided inter-node (replicate) groups.

    Every rank creates every group in the same order, as ``new_group`` requires.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if per_node <= 0 or world % per_node:
        raise ValueError(f"world_size({world}) is not a multiple of ranks per node({per_node})")
    shard = replicate = None
    for start in range(0, world, per_node):
        group = dist.new_group(list(range(start, start + per_node)))
        if start <= rank < start + per_node:
            shard = group
    for offset in range(per_node):
        group = dist.new_group(list(range(offset, world, per_node)))
        if rank % per_node == offset:
            replicate = group
    return Groups(shard, replicate)


def effective_strategy(strategy: ShardingStrategy | None, groups: Groups) -> ShardingStrategy:
    """Validate ``strategy`` and switch to NO_SHARD when the data-parallel world is 1 (as torch)."""
    if strategy is not None and not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a ShardingStrategy or None, got {strategy!r}")
    world = collectives.group_size(groups.shard) * (
        1 if groups.replicate is None else collectives.group_size(groups.replicate)
    )
    if world == 1:
        if strategy is not ShardingStrategy.NO_SHARD:
            warnings.warn(
                "FSDP is switching to use `NO_SHARD` instead of "
                f"{strategy or ShardingStrategy.FULL_SHARD} since the world size is 1.",
                stacklevel=5,
            )
        return ShardingStrategy.NO_SHARD
    return strategy or ShardingStrategy.FULL_SHARD


def unit_groups(groups: Groups, strategy: ShardingStrategy) -> UnitGroups:
    """The groups a unit with the effective ``strategy`` uses, and their sizes.

    NO_SHARD is a shard group of one with the whole group as replicate group.
    """
    inter_node = groups.replicate if strategy in HYBRID_STRATEGIES else None
    if strategy is ShardingStrategy.NO_SHARD:
        shard_group, replicate_group, shard_size, shard_rank = None, groups.shard, 1, 0
    else:
        shard_group, replicate_group = groups.shard, groups.replicate
        shard_size, shard_rank = collectives.group_size(groups.shard), collectives.group_rank(groups.shard)
    replicate_size = 1 if replicate_group is None else collectives.group_size(replicate_group)
    return UnitGroups(
        process_group=groups.shard,
        inter_node_pg=inter_node,
        shard_group=shard_group,
        replicate_group=replicate_group,
        shard_size=shard_size,
        shard_rank=shard_rank,
        dp_world_size=shard_size * replicate_size,
    )


# -- ignored modules ---------------------------------------------------------------------------
def collect_ignored(root: nn.Module, ignored_modules: Iterable[nn.Module] | None) -> set[nn.Module]:
    """Every module in the subtrees of ``ignored_modules`` (validated)."""
    if ignored_modules is None:
        return set()
    out: set[nn.Module] = set()
    for module in ignored_modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ignored_modules must contain nn.Module, got {type(module).__name__}")
        if is_unit(module):
            raise ValueError("ignored_modules should not contain FSDP instances")
        out.update(module.modules())
    return out


def managed_tensors(
    root: nn.Module, ignored: set[nn.Module], ignored_params: Sequence[nn.Parameter] = ()
) -> tuple[list[tuple[str, nn.Module, str, nn.Parameter]], list[tuple[nn.Module, str]]]:
    """This unit's own parameters (fqn, module, name, param) and buffers (module, name).

    Walks ``root`` without entering nested units or ignored modules; ``ignored_params`` are left out.
    """
    params: list[tuple[str, nn.Module, str, nn.Parameter]] = []
    buffers: list[tuple[nn.Module, str]] = []
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop(0)
        for name, param in module._parameters.items():
            if param is not None and not any(param is p for p in ignored_params):
                params.append((f"{prefix}{name}", module, name, param))
        buffers.extend((module, name) for name, buf in module._buffers.items() if buf is not None)
        for child_name, child in module._modules.items():
            if child is None or child in ignored or is_unit(child):
                continue
            stack.append((f"{prefix}{child_name}.", child))
    return params, buffers


def check_not_shared_with_nested(
    root: nn.Module, params: list[tuple[str, nn.Module, str, nn.Parameter]]
) -> None:
    """Reject a parameter of this unit that a nested unit under ``root`` already flattened, and one that two
    nested units flattened each (siblings wrapped one after the other: the second flattens what the first
    left of it, this rank's shard, and the ranks' units no longer match)."""
    nested: dict[int, str] = {}
    for fqn, sub in root.named_modules():
        state = unit_state(sub)
        for slot in [] if state is None or state.handle is None else state.handle.slots:
            name = f"{fqn}.{slot.fqn}"
            if id(slot.param) in nested:
                raise ValueError(
                    f"parameter {name!r} is shared with parameter {nested[id(slot.param)]!r} of another nested "
                    "unit; shared parameters must belong to one unit (wrap their common ancestor instead)"
                )
            nested[id(slot.param)] = name
    for fqn, _, _, param in params:
        if id(param) in nested:
            raise ValueError(
                f"parameter {fqn!r} is shared with nested unit parameter "
                f"{nested[id(param)]!r}; "
                "shared parameters must belong to one unit (wrap their common ancestor instead)"
            )


# -- devices -----------------------------------------------------------------------------------
def resolve_device_id(device_id: int | torch.device | None) -> torch.device | None:
    """Normalize ``device_id`` to a device with an index (CPU needs none)."""
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        raise TypeError(f"device_id must be an int, torch.device or None, got {device_id!r}")
    if isinstance(device_id, int):
        if device_id < 0:
            raise ValueError(f"device_id must be a non-negative device index, got {device_id}")
        return torch.device("cuda", device_id)
    if device_id.type == "cpu" or device_id.index is not None:
        return device_id
    module = getattr(torch, device_id.type)
    index = module.current_device()
    warnings.warn(
        f"FSDP got the argument `device_id` {device_id} on rank {dist.get_rank()}, which does not "
        f"have an explicit index. FSDP will use the current device {index}. If this is incorrect, "
        f"please explicitly call `torch.{device_id.type}.set_device()` before FSDP initialization "
        "or pass in the explicit device index as the `device_id` argument.",
        stacklevel=5,
    )
    return torch.device(device_id.type, index)


def place_module(
    root: nn.Module,
    ignored: set[nn.Module],
    device: torch.device | None,
    param_init_fn: Callable[[nn.Module], None] | None,
    ignored_params: Sequence[nn.Parameter] = (),
) -> torch.device:
    """Materialize meta modules, move managed tensors to ``device``; return the compute device."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"Expected param_init_fn to be a callable, but got {type(param_init_fn)}")
    params, buffers = managed_tensors(root, ignored, ignored_params)
    _materialize(root, ignored, params, buffers, device, param_init_fn)
    params, buffers = managed_tensors(root, ignored, ignored_params)
    devices = {param.device for _, _, _, param in params}
    cpu = torch.device("cpu")
    if len(devices) == 2 and cpu in devices and device is None:
        raise RuntimeError(
            "To support a module with both CPU and GPU params, please pass in device_id argument."
        )
    if len(devices - {cpu}) > 1 or (len(devices) > 1 and cpu not in devices):
        raise RuntimeError(f"FSDP only supports single device modules but got params on {devices}")
    on_device = next((d for d in devices if d.type != "cpu"), None)
    if device is not None:
        if on_device is None and not params and device.type != "cpu":
            # Nothing to move: the module computes on the current device, which must agree.
            on_device = torch.device(device.type, getattr(torch, device.type).current_device())
        if on_device is not None and device.type != "cpu" and on_device != device:
            raise ValueError(
                "Inconsistent compute device and `device_id` on rank "
                f"{_rank()}: {on_device} vs {device}"
            )
        _move(params, buffers, device)
        return device
    if on_device is not None:
        return on_device
    if torch.cuda.is_available():
        warnings.warn(
            "The passed-in `module` is on CPU and will thus have FSDP's sharding "
            "initialization run "
            "on CPU, which may be slower than on GPU. We recommend passing in the `device_id` "
            "argument for FSDP to move `module` to GPU for the sharding initialization.",
            stacklevel=5,
        )
        return torch.device("cuda", torch.cuda.current_device())
    return cpu


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _materialize(
    root: nn.Module,
    ignored: set[nn.Module],
    params: list[tuple[str, nn.Module, str, nn.Parameter]],
    buffers: list[tuple[nn.Module, str]],
    device: torch.device | None,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> None:
    meta_buffers = [m for m, n in buffers if (b := m._buffers[n]) is not None and b.is_meta]
    owners = [m for _, m, _, p in params if p.is_meta] + meta_buffers
    if not owners:
        return
    if param_init_fn is not None:
        # Called per module that owns meta tensors (never on ignored modules), as torch does.
        for module in dict.fromkeys(owners):
            param_init_fn(module)
        return
    target = device or (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    for module in dict.fromkeys(owners):
        module.to_empty(device=target, recurse=False)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()


def _move(
    params: list[tuple[str, nn.Module, str, nn.Parameter]],
    buffers: list[tuple[nn.Module, str]],
    device: torch.device,
) -> None:
    with torch.no_grad():
        for _, _, _, param in params:
            if param.device != device:
                param.data = param.data.to(device)
        for module, name in buffers:
            buf = module._buffers[name]
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def sync_module_states(
    params: list[tuple[str, nn.Module, str, nn.Parameter]],
    buffers: list[tuple[nn.Module, str]],
    groups: Groups,
    compute_device: torch.device,
) -> None:
    """Broadcast global rank 0's managed params and buffers (over shard, then replicate group)."""
    tensors = [param.detach() for _, _, _, param in params]
    tensors += [b for m, n in buffers if (b := m._buffers[n]) is not None]
    if compute_device.type != "cpu" and any(t.device.type == "cpu" for t in tensors):
        raise ValueError(
            "The module has CPU parameters or buffers when `sync_module_states=True`, "
            "which requires "
            "them to be on GPU. Please specify the `device_id` argument or move the module to GPU "
            "before passing it to FSDP."
        )
    for group in (groups.shard, groups.replicate):
        if group is None or collectives.group_size(group) == 1:
            continue
        src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        pending = [collectives.broadcast(t, src, group) for t in tensors]
        for item in pending:
            item.wait()
