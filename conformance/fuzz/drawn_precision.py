"""Mixed precision in the fuzzer: the drawn policy as a wrap spec, the local baseline, tolerances.

[Note: fuzz mixed-precision baseline]
With a :class:`~conformance.fuzz.example.Policy` the baseline is the local
float32 model trained as a mixed-precision data-parallel job would train it
(the emulation of ``fixtures.precision``, [Note: local mixed precision], whose
helpers it uses): for every rank's batch a copy of the model cast to the param
dtype (buffers to the buffer dtype) computes the loss and its gradients; each
rank's gradients are cast to the reduce dtype (the param dtype when unset),
summed and divided by the world size in that dtype, cast to float32 and added
to the local model's gradients, one backward at a time, as an FSDP accumulates
reduced gradients (the stateful fuzzer's backwards without gradient sync keep
each rank's gradient unreduced instead, see [Note: unsynced accumulation dtype]
in :mod:`conformance.fuzz.shadow`). Parameters and optimizer state stay in
float32.

Tolerances are ``torch.testing.assert_close``'s defaults for the dtype a value
carries the precision of ([Note: exact comparisons] in ``fixtures.parity``):

* losses are float32 reductions of outputs computed in the param dtype, and
  every rank's gradient is computed in the param dtype before any reduction, so
  both sides are cast to the param dtype and compared with its defaults (a
  reduction order or a rounding flipped by a float32 ulp in the parameters
  changes them at that dtype's precision, not at float32's);
* parameters stay float32 on both sides and keep float32's defaults: a master
  copy rounded to the param dtype, or an update lost, shows there.

Inputs: the baseline gets each batch with its floating tensors cast to the param dtype by
:func:`model_input`, and so does the wrapped model, with ``cast_forward_inputs=False`` in its wrap
spec, unless the policy says ``cast_inputs``: then the wrapped model gets the batch as it is and
its root casts it (``cast_forward_inputs=True``, :attr:`Capability.MP_CAST_FORWARD_INPUTS`), which
must give the same values (:func:`wrapped_input`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from conformance.contract.adapter import Capability, FSDPAdapter, MixedPrecisionSpec
from conformance.contract.optional import capabilities_of
from conformance.fuzz.example import PRECISION_FEATURES, Policy
from conformance.fuzz.model import loss_of
from fixtures.precision import average_grads, low_precision_copy

__all__ = [
    "dtype_of", "mixed_precision_spec", "required", "precision_features", "precision_note", "low_precision_model",
    "local_backward", "as_compared", "compared_outputs", "in_compute_dtype", "model_input", "wrapped_input",
]


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``"bfloat16"`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype


def mixed_precision_spec(policy: Policy | None) -> MixedPrecisionSpec | None:
    """The adapter-level policy for ``policy`` (``None``: no mixed precision)."""
    if policy is None:
        return None
    return MixedPrecisionSpec(
        param_dtype=dtype_of(policy.param_dtype),
        reduce_dtype=None if policy.reduce_dtype is None else dtype_of(policy.reduce_dtype),
        buffer_dtype=None if policy.buffer_dtype is None else dtype_of(policy.buffer_dtype),
        keep_low_precision_grads=policy.keep_low_precision_grads,
        cast_forward_inputs=policy.cast_inputs,
    )


def model_input(batch: torch.Tensor, policy: Policy | None) -> torch.Tensor:
    """``batch`` as the fuzzers feed it to both models: floating in the param dtype under a policy
    (see the module note), token ids and batches without a policy unchanged."""
    if policy is None or not batch.is_floating_point():
        return batch
    return batch.to(dtype_of(policy.param_dtype))


def wrapped_input(batch: torch.Tensor, policy: Policy | None) -> torch.Tensor:
    """``batch`` as the fuzzers feed it to the wrapped model: as it is where the root casts it
    (``cast_inputs``), else :func:`model_input`'s (see the module note)."""
    return batch if policy is not None and policy.cast_inputs else model_input(batch, policy)


def required(policy: Policy | None) -> list[Capability]:
    """The capabilities an implementation needs to run ``policy``."""
    spec = mixed_precision_spec(policy)
    return [] if spec is None else spec.required()


def precision_features(impl: FSDPAdapter) -> frozenset[str]:
    """The :data:`~conformance.fuzz.example.PRECISION_FEATURES` ``impl`` supports."""
    caps = capabilities_of(impl)
    if Capability.MIXED_PRECISION not in caps:
        return frozenset()
    if Capability.MP_BUFFER_DTYPE not in caps:
        return frozenset({"mixed_precision"})
    return PRECISION_FEATURES


def precision_note(impl: FSDPAdapter) -> str:
    """What of a policy the fuzzer leaves out for ``impl`` (empty: nothing)."""
    features = precision_features(impl)
    if "mixed_precision" not in features:
        return f"no mixed-precision policy drawn: {impl.name} lacks {Capability.MIXED_PRECISION}"
    if "buffer_dtype" not in features:
        return f"no buffer_dtype drawn: {impl.name} lacks {Capability.MP_BUFFER_DTYPE}"
    return ""


def low_precision_model(local: nn.Module, policy: Policy | None) -> nn.Module | None:
    """The baseline's copy of ``local`` computing in the policy's dtypes (``None`` without a policy)."""
    spec = mixed_precision_spec(policy)
    if spec is None:
        return None
    assert spec.param_dtype is not None
    return low_precision_copy(local, spec.param_dtype, spec.buffer_dtype)


def local_backward(
    local: nn.Module, low: nn.Module, batches: list[torch.Tensor], policy: Policy
) -> list[torch.Tensor]:
    """One backward of every rank's batch under ``policy``, as [Note: fuzz mixed-precision baseline]
    says, on ``low`` (from :func:`low_precision_model`, its parameters refreshed from ``local``'s
    first); adds the averaged gradients to ``local``'s and returns each rank's loss."""
    spec = mixed_precision_spec(policy)
    assert spec is not None and spec.param_dtype is not None
    with torch.no_grad():  # a copy per backward would cost as much as the backward itself
        for low_param, param in zip(low.parameters(), local.parameters(), strict=True):
            low_param.copy_(param)
    losses, per_rank = [], []
    for batch in batches:
        loss = loss_of(low(model_input(batch, policy)))
        loss.backward()
        losses.append(loss.detach())
        per_rank.append({name: p.grad for name, p in low.named_parameters() if p.grad is not None})
        low.zero_grad(set_to_none=True)
    reduced = average_grads(per_rank, spec.reduce_dtype or spec.param_dtype)
    for name, param in local.named_parameters():
        if name in reduced:
            grad = reduced[name].to(param.dtype)
            param.grad = grad if param.grad is None else param.grad.add_(grad)
    return losses


def as_compared(tensor: torch.Tensor, policy: Policy | None) -> torch.Tensor:
    """``tensor`` cast to the param dtype under a policy, so that comparing it uses that dtype's
    default tolerances (see the module note); unchanged without one."""
    return tensor if policy is None else tensor.to(dtype_of(policy.param_dtype))


def compared_outputs(output: torch.Tensor | tuple[torch.Tensor, ...], policy: Policy | None) -> dict[str, torch.Tensor]:
    """A forward's outputs by position, each :func:`as_compared` (detached)."""
    outputs = output if isinstance(output, tuple) else (output,)
    return {str(i): as_compared(o.detach(), policy) for i, o in enumerate(outputs)}


def in_compute_dtype(
    tensors: Mapping[str, torch.Tensor | None], policy: Policy | None
) -> dict[str, torch.Tensor | None]:
    """:func:`as_compared` for every tensor of a name -> tensor mapping."""
    return {name: None if t is None else as_compared(t, policy) for name, t in tensors.items()}
