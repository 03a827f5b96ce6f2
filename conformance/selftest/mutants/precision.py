"""Mixed-precision mutants: one dtype of the policy ignored, or the root's inputs left uncast or all cast."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_map

from conformance.contract.adapter import WrapSpec
from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = [
    "ParamDtypeIgnored",
    "ReduceInParamDtype",
    "BufferDtypeIgnored",
    "LowPrecisionGradsUpcast",
    "EvalInLowPrecision",
    "RootInputsNotCast",
    "EveryInputCast",
]

_PARAM_REDUCE = "mixed_precision/param_and_reduce_dtypes"


class _PolicyMutant(_Mutant):
    """Rewrites the mixed-precision policy a case asks for before wrapping."""

    #: ``MixedPrecisionSpec`` fields replaced whenever a case gives a policy.
    policy_overrides: dict[str, Any] = {}

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        spec = super()._mutate_spec(spec)
        if spec.mixed_precision is None:
            return spec
        return replace(spec, mixed_precision=replace(spec.mixed_precision, **self.policy_overrides))


class ParamDtypeIgnored(_PolicyMutant):
    """Gathers and computes in the parameters' own dtype whatever ``param_dtype`` says."""

    name = "mutant-param-dtype-ignored"
    breaks = "computing and all-gathering in param_dtype"
    policy_overrides = {"param_dtype": None}
    #: No stateful row is claimed: since the programs list NoSync, Save and Load after Train, the main job's
    #: budget (seed 0) draws no program at world size 1 whose values this changes.
    expect = Expect("param_and_reduce_dtypes", "thread", (_PARAM_REDUCE,))


class ReduceInParamDtype(_PolicyMutant):
    """Reduces gradients in the param dtype instead of ``reduce_dtype``."""

    name = "mutant-reduce-in-param-dtype"
    breaks = "reducing gradients in reduce_dtype"
    policy_overrides = {"reduce_dtype": None}
    expect = Expect(
        "param_and_reduce_dtypes or keep_low_precision_grads or buffer_dtype", "thread",
        (f"{_PARAM_REDUCE}[reduce_dtype=float32]", "mixed_precision/keep_low_precision_grads[reduce_dtype=float32]",
         "mixed_precision/buffer_dtype"),
    )


class BufferDtypeIgnored(_PolicyMutant):
    """Leaves buffers in their own dtype whatever ``buffer_dtype`` says."""

    name = "mutant-buffer-dtype-ignored"
    breaks = "casting buffers to buffer_dtype"
    policy_overrides = {"buffer_dtype": None}
    expect = Expect("buffer_dtype", "thread", ("mixed_precision/buffer_dtype",))


class LowPrecisionGradsUpcast(_PolicyMutant):
    """Upcasts gradients to the parameters' dtype despite ``keep_low_precision_grads``."""

    name = "mutant-low-precision-grads-upcast"
    breaks = "keep_low_precision_grads"
    policy_overrides = {"keep_low_precision_grads": False}
    expect = Expect(
        "keep_low_precision_grads", "thread",
        ("mixed_precision/keep_low_precision_grads[reduce_dtype=None]",),
    )


def _always_low_precision(_original: Any) -> Any:
    def low_precision(config: Any, training: bool) -> Any:
        return config.mixed_precision

    return low_precision


class EvalInLowPrecision(_Mutant):
    """Ignores ``FSDP_USE_FULL_PREC_IN_EVAL``: eval forwards run under the mixed-precision policy."""

    name = "mutant-eval-in-low-precision"
    breaks = "full precision in eval"
    expect = Expect("full_precision_in_eval", "thread", ("mixed_precision/full_precision_in_eval",))
    patches = (Patch("fsdp_impl.unit_state:UnitConfig.low_precision", _always_low_precision),)


def _uncast(_unit: Any, inputs: Any) -> Any:
    return inputs


class RootInputsNotCast(_Mutant):
    """Hands the root its forward inputs in their own dtype whatever ``param_dtype`` says."""

    name = "mutant-root-inputs-not-cast"
    breaks = "casting the root's floating forward inputs to param_dtype"
    expect = Expect("cast_forward_inputs", "thread", ("mixed_precision/cast_forward_inputs",))
    patches = (Patch.instead("fsdp_impl.precision:cast_inputs", _uncast),)


def _every_tensor_cast(cast_inputs: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def cast_every_tensor(unit: Any, inputs: Any) -> Any:
        if cast_inputs(unit, inputs) is inputs:  # the unit casts nothing
            return inputs
        dtype = unit.config.low_precision(unit.training).param_dtype
        return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) else x, inputs)

    return cast_every_tensor


class EveryInputCast(_Mutant):
    """Casts every tensor among the forward inputs to ``param_dtype``, token ids and masks too."""

    name = "mutant-every-input-cast"
    breaks = "leaving non-floating forward inputs as they are when casting inputs"
    expect = Expect("non_floating_inputs", "process", ("mixed_precision/non_floating_inputs",))
    patches = (Patch("fsdp_impl.precision:cast_inputs", _every_tensor_cast),)
