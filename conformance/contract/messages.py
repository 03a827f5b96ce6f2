"""What the contract says an implementation prints: the errors and warnings its cases and the stateful fuzzer
match, as torch's FSDP words them, and the environment variables it reads. Each belongs to the
:class:`~conformance.contract.adapter.Capability` named beside it."""

from __future__ import annotations

__all__ = [
    "FULL_PRECISION_IN_EVAL",
    "INVALID_PG_ERROR",
    "MANUAL_WRAP_ERROR",
    "NO_SHARD_SWITCH",
    "OPTIM_IN_BACKWARD_ERROR",
    "ORDER_CHANGED",
    "ORDER_ERROR",
    "ORDER_WARNING",
    "UNSAFE_SETATTR",
]

#: How the warning of :attr:`Capability.WORLD_SIZE_1_SWITCH` starts.
NO_SHARD_SWITCH = "FSDP is switching to use `NO_SHARD` instead of"
#: The ValueError of :attr:`Capability.HYBRID_MANUAL_WRAP_CHECK` (a hybrid wrap given neither groups nor a mesh).
MANUAL_WRAP_ERROR = "requires explicit specification of process group or device_mesh."
#: How the ValueError of :attr:`Capability.HYBRID_PG_VALIDATION` (one group for a hybrid strategy) starts.
INVALID_PG_ERROR = "Expected process_group to be passed in"
#: The RuntimeError of :attr:`Capability.OPTIM_IN_BACKWARD_CHECK` (optimizer-in-backward on flat parameters).
OPTIM_IN_BACKWARD_ERROR = "only supported with use_orig_params=True"
#: The environment variable of :attr:`Capability.MP_FULL_PRECISION_IN_EVAL` (``"1"`` at wrap time: on).
FULL_PRECISION_IN_EVAL = "FSDP_USE_FULL_PREC_IN_EVAL"
#: The environment variable of :attr:`Capability.UNSAFE_SETATTR` (``"1"``: modules' ``__setattr__`` bypassed).
UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"
#: How :attr:`Capability.EXEC_ORDER_VALIDATION`'s messages start: the RuntimeError of a first forward whose
#: unit order differs across ranks, and every order warning (the one of a later change: :data:`ORDER_CHANGED`).
ORDER_ERROR = "Forward order differs across ranks"
ORDER_WARNING = "Forward order differs"
#: The warning to a rank whose forward order changed after the first iteration (``.format(rank=...)``).
ORDER_CHANGED = ("Forward order differs from that of the first iteration on rank {rank}. "
                 "Collectives are unchecked and may give incorrect results or hang")
