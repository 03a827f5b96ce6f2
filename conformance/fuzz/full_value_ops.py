"""What the wrapped model runs for the stateful operations whose semantics are stated in full values: clipping the
gradients to a total norm, scaling the full parameters and reading a unit's full parameters
(:class:`~conformance.fuzz.ops.ClipGradNorm`, :class:`~conformance.fuzz.ops.ScaleParams`,
:class:`~conformance.fuzz.ops.SummonFull`; the shadow's side is :class:`~conformance.fuzz.shadow.Shadow`'s)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import FSDPAdapter
from conformance.fuzz.configs import ProgramConfig, WrapConfig
from conformance.fuzz.controls import full_value
from conformance.fuzz.ops import SummonFull
from fixtures.parity import assert_close_named

__all__ = ["assert_norm", "assert_summoned", "clip_grads", "clipped_norm_type", "has_grads", "scale_params",
           "summon_options", "summoned_names"]


def clipped_norm_type(config: ProgramConfig, norm_type: float) -> float:
    """The norm a :class:`~conformance.fuzz.ops.ClipGradNorm` of ``norm_type`` takes on ``config``: the infinity
    norm only where no rank's piece of a gradient can be empty (one rank, a ``NO_SHARD`` wrap, or a ``wrap``
    program's flat parameters, padded to the world size), else the 2-norm: torch's norms refuse the infinity
    norm of an empty tensor ("no identity"), whatever shards it."""
    if not math.isinf(norm_type) or config.world_size == 1:
        return norm_type
    flat = isinstance(config, WrapConfig) and (not config.use_orig_params or config.strategy == "NO_SHARD")
    return norm_type if flat else 2.0


def has_grads(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` has a gradient."""
    return any(param.grad is not None for param in module.parameters())


def clip_grads(impl: FSDPAdapter, model: nn.Module, *, fully_sharded: bool, max_norm: float,
               norm_type: float) -> torch.Tensor:
    """Clip ``model``'s gradients as its user does and return the total norm, whole (collective): a wrapped
    model's own ``clip_grad_norm_`` through the adapter, a ``fully_shard``-ed one's
    ``torch.nn.utils.clip_grad_norm_`` over its parameters (a DTensor norm, gathered)."""
    if fully_sharded:
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm, norm_type=norm_type)
        return full_value(norm)
    return optional.clip_grad_norm(impl, model, max_norm, norm_type).detach()


def assert_norm(got: torch.Tensor, want: torch.Tensor) -> None:
    """The total norm returned equals the shadow's, in the shadow's dtype and with its tolerance."""
    torch.testing.assert_close(got.to(want.device, want.dtype), want,
                               msg=lambda message: f"the total gradient norm returned: {message}")


def scale_params(impl: FSDPAdapter, model: nn.Module, *, fully_sharded: bool, scale: float) -> None:
    """Multiply ``model``'s full parameters by ``scale`` in place, as its user does (collective): a wrapped
    model's ``apply`` through the adapter, scaling each module's own parameters on the full values it summons; a
    ``fully_shard``-ed one's parameters (DTensors: each rank scales its shards) under ``torch.no_grad()``."""
    if fully_sharded:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)
        return
    optional.apply_with_full_params(impl, model, _scaling_own_params(scale))


def _scaling_own_params(scale: float) -> Callable[[nn.Module], None]:
    """A function for ``apply``: scale the module's own parameters by ``scale``, each parameter once (a tied one
    is some modules' own parameter each). What it scaled is held until ``apply`` returns: a wrapper's summoned
    parameters are new objects each summon, freed at its end, and a freed object's ``id`` may be given to the
    next one, which a set of ids would then wrongly call scaled."""
    done: dict[int, torch.Tensor] = {}

    def scale_own(module: nn.Module) -> None:
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                if id(param) not in done:
                    done[id(param)] = param
                    param.mul_(scale)

    return scale_own


def summon_options(config: WrapConfig, op: SummonFull) -> tuple[bool, bool]:
    """``offload_to_cpu`` and ``with_grads`` as a :class:`~conformance.fuzz.ops.SummonFull` runs them on ``config``:
    each dropped where torch leaves it unsupported (an offload of a unit that does not shard; gradients without
    ``use_orig_params`` or beside an offload)."""
    offload = op.offload_to_cpu and config.world_size > 1 and config.strategy != "NO_SHARD"
    return offload, op.with_grads and config.use_orig_params and not offload


def summoned_names(config: WrapConfig, local: nn.Module, unit: str, recurse: bool) -> list[str]:
    """The parameters of ``local`` (the shadow's model) a summon on ``unit`` exposes full: those below it, without
    ``recurse`` less those below a unit nested in it; a tied parameter (one module's, or another unit's, as the
    implementation chose) left out."""
    uses = Counter(id(param) for _, param in local.named_parameters(remove_duplicate=False))
    prefix = f"{unit}." if unit else ""
    nested = tuple(f"{path}." for path in config.units() if path != unit and path.startswith(prefix))
    return [name for name, param in local.named_parameters()
            if name.startswith(prefix) and uses[id(param)] == 1 and (recurse or not name.startswith(nested))]


def assert_summoned(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, offloaded: Sequence[str]) -> None:
    """Every parameter in ``want`` was summoned, full, equal to the shadow's; those ``offloaded`` on the CPU (an
    ignored module's parameters are the implementation's to leave where they are)."""
    absent = sorted(set(want) - set(got))
    if absent:
        raise AssertionError(f"not among the summoned parameters: {absent} (summoned: {sorted(got)})")
    elsewhere = sorted(name for name in offloaded if got[name].device.type != "cpu")
    if elsewhere:
        raise AssertionError(f"offload_to_cpu=True left {elsewhere} on {got[elsewhere[0]].device}")
    assert_close_named({name: got[name].to(want[name].device) for name in want}, want, what="summoned params")
