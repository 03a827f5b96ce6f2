"""Operations of a stateful program whose semantics are stated in full values: clipping the gradients to a total
norm, scaling the full parameters ([Note: stateful programs] in :mod:`conformance.fuzz.ops`). Each runs on the
wrapped model through the adapter and on the shadow ([Note: the shadow model] in :mod:`conformance.fuzz.shadow`)
and compares what the user reads back; the state check that follows every operation compares the rest."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.fuzz.configs import ProgramConfig, WrapConfig
from conformance.fuzz.controls import full_value
from conformance.fuzz.ops import ClipGradNorm, ScaleParams

if TYPE_CHECKING:
    from conformance.fuzz.machine import Machine

__all__ = ["clip_grad_norm", "clipped_norm_type", "scale_params"]


def clipped_norm_type(config: ProgramConfig, norm_type: float) -> float:
    """The norm a :class:`ClipGradNorm` of ``norm_type`` takes on ``config``: the infinity norm only where no rank's
    piece of a gradient can be empty (one rank, or a ``wrap`` program's flat parameters, padded to the world
    size), else the 2-norm: torch's norms refuse the infinity norm of an empty tensor, whatever shards it."""
    if not math.isinf(norm_type) or config.world_size == 1:
        return norm_type
    flat = isinstance(config, WrapConfig) and (not config.use_orig_params or config.strategy == "NO_SHARD")
    return norm_type if flat else 2.0


def _has_grads(module: nn.Module) -> bool:
    return any(param.grad is not None for param in module.parameters())


def clip_grad_norm(machine: Machine, op: ClipGradNorm) -> None:
    """Clip both sides' gradients (see :class:`ClipGradNorm`) and compare the total norms returned."""
    unsynced = machine.controls is not None and machine.controls.unsynced
    if machine.pending is not None or unsynced or not _has_grads(machine.shadow.local):
        return
    if machine.controls is None and ("clip_grad_norm" in machine.missing or machine.config.dtype == "float64"):
        return
    norm_type = clipped_norm_type(machine.config, op.norm_type)
    if machine.controls is not None:
        params = list(machine.model.parameters())
        got = full_value(torch.nn.utils.clip_grad_norm_(params, op.max_norm, norm_type=norm_type))
    else:
        got = optional.clip_grad_norm(machine.impl, machine.model, op.max_norm, norm_type).detach()
    want = torch.nn.utils.clip_grad_norm_(machine.shadow.local.parameters(), op.max_norm, norm_type=norm_type)
    machine.compare("total norm", _assert_norm, got, want)


def _assert_norm(got: torch.Tensor, want: torch.Tensor) -> None:
    """The total norm returned equals the shadow's, in the shadow's dtype and with its tolerance."""
    torch.testing.assert_close(got.to(want.device, want.dtype), want,
                               msg=lambda message: f"the total gradient norm returned: {message}")


def scale_params(machine: Machine, op: ScaleParams) -> None:
    """Multiply both sides' full parameters by ``op.scale`` (see :class:`ScaleParams`)."""
    if machine.pending is not None:
        return
    if machine.controls is not None:
        machine.controls.before_update(machine.config)  # nothing kept unsharded: the shards are what is written
        with torch.no_grad():
            for param in machine.model.parameters():
                param.mul_(op.scale)
    elif "apply_with_full_params" in machine.missing:
        return
    else:
        optional.apply_with_full_params(machine.impl, machine.model, _scaling_own_params(op.scale))
    with torch.no_grad():
        for param in machine.shadow.local.parameters():
            param.mul_(op.scale)


def _scaling_own_params(scale: float) -> Callable[[nn.Module], None]:
    """A function for ``apply``: scale the module's own parameters by ``scale``, each parameter once."""
    done: set[int] = set()

    def scale_own(module: nn.Module) -> None:
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                if id(param) not in done:
                    done.add(id(param))
                    param.mul_(scale)

    return scale_own
