"""The checks both fuzzers make of the wrapped model against its local twin (the baseline or the shadow).

Names are compared as the local model has them (:func:`unwrapped_names`: no
activation-checkpoint wrapper). A missing gradient (``None``) and an all-zero
one are treated alike (:func:`zeros_for_none`): flat-parameter implementations
cannot tell them apart within a unit, and ``training/module_no_compute_grad``
checks that contract on its own; :func:`assert_no_grads_outside_the_loss`
still tells them apart for whole units. Missing optimizer state and all-zero
state are alike too (:func:`assert_optim_state`). Each check raises
``AssertionError``, which the fuzzer keeps as its verdict ([Note: fuzz
verdicts agree across ranks]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from conformance.contract.adapter import UnitInfo

__all__ = ["assert_dtypes", "assert_no_grads_outside_the_loss", "assert_optim_state", "assert_same_dtypes",
           "tensors_of", "unwrapped_name", "unwrapped_names", "zeros_for_none"]


def assert_same_dtypes(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> None:
    """Every gradient both sides have is in the same dtype (``keep_low_precision_grads`` leaves them low)."""
    differ = {}
    for name, grad in got.items():
        other = want.get(name)
        if grad is not None and other is not None and grad.dtype != other.dtype:
            differ[name] = (grad.dtype, other.dtype)
    if differ:
        raise AssertionError(f"gradient dtypes (wrapped, shadow) differ: {differ}")


def assert_dtypes(output: torch.Tensor | tuple[torch.Tensor, ...], want: str) -> None:
    """Every output of the wrapped model is in dtype ``want`` (a mixed-precision policy's param dtype)."""
    outputs = output if isinstance(output, tuple) else (output,)
    got = [str(o.dtype).removeprefix("torch.") for o in outputs]
    if any(name != want for name in got):
        raise AssertionError(f"the wrapped model's outputs are {got}, expected {want} (the policy's param_dtype)")


def unwrapped_name(name: str) -> str:
    """``name`` without the activation-checkpoint wrapper this fuzzer may put in (the shadow has none)."""
    return ".".join(part for part in name.split(".") if part != "_checkpoint_wrapped_module")


def unwrapped_names(named: dict[str, Any]) -> dict[str, Any]:
    """``named`` with :func:`unwrapped_name` names."""
    return {unwrapped_name(name): value for name, value in named.items()}


def assert_no_grads_outside_the_loss(units: Sequence[UnitInfo], grads: dict[str, torch.Tensor | None] | None,
                                     local: nn.Module) -> None:
    """A unit none of whose parameters has a gradient in ``local`` shows the user none either.

    torch leaves ``grad`` None on a parameter that took no part in any loss since its gradient was
    last set to None (and on a frozen one); a zero gradient is not that. What the user sees is
    ``grads`` (the full gradients, by the local model's names) where the adapter exposes them, else
    the unit's own local gradients (a flat parameter's, which its optimizer steps). A flat parameter
    cannot tell None from zero for some parameters of a unit whose others are used, so only whole
    units are judged (never the root: it holds the head). Unit names are :func:`unwrapped_name`'s.
    """
    fqns = {unit.fqn: unwrapped_name(unit.fqn) for unit in units}
    named = dict(local.named_parameters())
    owner = {name: max((f for f in fqns.values() if f and name.startswith(f + ".")), key=len, default="")
             for name in named}
    for unit in units:
        owned = [name for name in named if fqns[unit.fqn] and owner[name] == fqns[unit.fqn]]
        if not owned or any(named[name].grad is not None for name in owned):
            continue
        seen = unit.held_grads() if grads is None else [grads.get(name) for name in owned]
        present = [grad is not None for grad in seen]
        if any(present):
            raise AssertionError(f"unit {fqns[unit.fqn]!r} took no part in a loss (its {len(owned)} parameters have "
                                 f"no gradient locally), yet shows gradients {present}: a zero gradient is not None")


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda message: prefix + message


def _common_dtype(got: Any, want: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Both values as CPU tensors of the dtype they promote to, so they are compared at that dtype's default
    tolerance (a float32 moment at float32's, not float64's; an int step count exactly)."""
    got_t, want_t = torch.as_tensor(got).cpu(), torch.as_tensor(want).cpu()
    dtype = torch.promote_types(got_t.dtype, want_t.dtype)
    return got_t.to(dtype), want_t.to(dtype)


def assert_optim_state(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    """Per-parameter optimizer state equal; a parameter with state on one side only must have all-zero
    tensors there (see [Note: stateful invariant] in :mod:`conformance.fuzz.stateful`), whatever its
    step count."""
    for name in sorted(set(got) | set(want)):
        if name in got and name in want:
            for key in sorted(set(got[name]) | set(want[name])):
                if key not in got[name] or key not in want[name]:
                    raise AssertionError(f"optim[{name}]: {key!r} on one side only")
                got_value, want_value = _common_dtype(got[name][key], want[name][key])
                torch.testing.assert_close(got_value, want_value, msg=_prefixed(f"optim[{name}][{key}]: "))
            continue
        one = got.get(name, want.get(name, {}))
        nonzero = [k for k, v in one.items() if k != "step" and isinstance(v, torch.Tensor) and bool(v.any())]
        if nonzero:
            side = "wrapped model" if name in got else "shadow"
            raise AssertionError(f"optim[{name}]: only the {side} has state, and its {nonzero} are not zero")


def zeros_for_none(
    grads: dict[str, torch.Tensor | None], other: dict[str, torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """``grads`` with a ``None`` replaced by zeros where ``other`` has a tensor (see the module note)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, grad in grads.items():
        peer = other.get(name)
        out[name] = torch.zeros_like(peer) if grad is None and peer is not None else grad
    return out


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a state dict (its other entries left out)."""
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
