"""FSDP1's methods on a wrapped model that act on every unit in its tree: ``fsdp_modules``, ``check_is_root``,
``clip_grad_norm_`` and ``register_comm_hook``.

``clip_grad_norm_`` takes the norm of every gradient the model's parameters hold as one vector: a sharded
unit's gradient is this rank's piece, so those norms are summed over the root's process group (their maximum
for the infinity norm); a ``NO_SHARD`` unit's gradient, and a parameter no unit manages (an ignored module's),
is whole on every rank and counted once, here. Every gradient is then scaled by
``max_norm / (total + 1e-6)`` where that is below 1, as :func:`torch.nn.utils.clip_grad_norm_` does.
Norms are taken in float32, or in the parameters' widest dtype where that is wider: the total norm is
returned in the gradients' promoted dtype (torch's docstring), and a float64 gradient is never narrowed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import collectives, unit
from fsdp_impl.api import ShardingStrategy, TrainingState
from fsdp_impl.unit_state import UnitState, is_unit, unit_state, unit_states

__all__ = ["check_is_root", "clip_grad_norm_", "fsdp_modules", "register_comm_hook"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def fsdp_modules(module: nn.Module, root_only: bool) -> list[nn.Module]:
    """Every unit in ``module``'s tree, ``module`` itself included; with ``root_only`` those under no other."""
    units = [sub for sub in module.modules() if is_unit(sub)]
    if not root_only:
        return units
    inner = {id(sub) for u in units for sub in u.modules() if sub is not u and is_unit(sub)}
    return [u for u in units if id(u) not in inner]


def check_is_root(module: nn.Module) -> bool:
    """Whether the unit ``module`` is its root (lazy init makes the unit asked first a root, as torch's)."""
    state = unit_state(module)
    assert state is not None, "check_is_root takes a unit"
    if state.root is None:
        unit.lazy_init(module)
    return bool(state.is_root)


def _grads(root: nn.Module, state: UnitState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of sharded units' parameters (this rank's pieces) and of all others (whole)."""
    assert state.root is not None
    sharded: list[torch.Tensor] = []
    whole: list[torch.Tensor] = []
    managed: set[int] = set()
    for member in state.root.units:
        handle = member.handle
        if handle is None:
            continue
        managed.update([id(handle.flat_param)] + [id(slot.param) for slot in handle.slots])
        params = [slot.param for slot in handle.slots] if handle.use_orig_params else [handle.flat_param]
        (sharded if handle.shard_size > 1 else whole).extend(p.grad for p in params if p.grad is not None)
    whole.extend(p.grad for p in root.parameters() if id(p) not in managed and p.grad is not None)
    return sharded, whole


def _local_norm(grads: list[torch.Tensor], norm_type: float, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of ``grads`` as one vector, computed in ``dtype`` (0 without any)."""
    grads = [g for g in grads if g.numel()]  # an empty piece adds nothing (and the inf-norm refuses it)
    if not grads:
        return torch.zeros((), device=device, dtype=dtype)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=dtype).to(device) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip every gradient of the root unit ``module``'s model to total norm ``max_norm``; the total norm,
    in the widest of the gradients' dtypes (collective; see the module docstring)."""
    if not check_is_root(module):
        raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP instance")
    state = unit_state(module)
    assert state is not None
    if state.training_state is not TrainingState.IDLE:
        raise RuntimeError(f"clip_grad_norm_ needs an idle root, got {state.training_state}")
    sharded, whole = _grads(module, state)
    norm_type, device = float(norm_type), state.compute_device
    # float32, or the parameters' widest dtype where wider (never narrowing a gradient); the same on every rank,
    # whichever gradients a rank's pieces hold, so the reduction below joins tensors of one dtype
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in module.parameters()], torch.float32)
    total = _local_norm(sharded, norm_type, dtype, device)
    rest = _local_norm(whole, norm_type, dtype, device)
    if norm_type == math.inf:
        total = torch.maximum(total, rest)
        collectives.all_reduce(total, state.groups.process_group, op=dist.ReduceOp.MAX).wait()
    else:
        total = total**norm_type
        collectives.all_reduce(total, state.groups.process_group).wait()
        total = (total + rest**norm_type) ** (1.0 / norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    grads = sharded + whole
    for grad in grads:
        grad.mul_(coef.to(grad.device, grad.dtype))
    dtypes = [grad.dtype for grad in grads] or [total.dtype]
    return total.to(functools.reduce(torch.promote_types, dtypes))


def register_comm_hook(module: nn.Module, state: object, hook: Callable[..., None]) -> None:
    """Make ``hook`` (with ``state``) reduce the gradient of every unit under the root ``module``
    ([Note: comm hook] in ``reduction.py``); before the first forward, once, not for hybrid strategies."""
    if not check_is_root(module):
        raise AssertionError("register_comm_hook can only be called on a root instance.")
    if not callable(hook):
        raise ValueError(f"The communication hook must be callable but got {hook}")
    units = unit_states(module)
    for member in units:
        if member.config.sharding_strategy in _HYBRID:
            raise AssertionError(
                f"Communication hook is not supported for hybrid strategies: {member.config.sharding_strategy}")
        if member.controls.comm_hook is not None:
            raise AssertionError("A communication hook is already registered")
    for member in units:
        member.controls.comm_hook = (state, hook)
