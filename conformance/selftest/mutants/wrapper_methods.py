"""Mutants of FSDP1's methods on a wrapped model and of its wrapper-only arguments (``clip_grad_norm_``,
``apply``, ``check_is_root``, ``fsdp_modules``, ``named_buffers``, ``register_comm_hook``, ``ignored_states``,
``MixedPrecision.cast_forward_inputs``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["ClipNormOfLocalShards", "ClipScalesNothing"]

Fn = Callable[..., Any]


def _shards_counted_whole(grads: Fn) -> Fn:
    def counted_whole(root: Any, state: Any) -> tuple[list[Any], list[Any]]:
        sharded, whole = grads(root, state)
        return [], sharded + whole

    return counted_whole


class ClipNormOfLocalShards(_Mutant):
    """``clip_grad_norm_`` takes the norm of this rank's pieces of sharded gradients alone, over no rank (the
    infinity norm is not broken: the maximum over ranks of each rank's maximum is the maximum)."""

    name = "mutant-clip-norm-of-local-shards"
    breaks = "summing the sharded gradients' norms over the ranks"
    expect = Expect("grad_clip and wrapper_clip_grad_norm", "thread",
                    ("grad_clip/wrapper_clip_grad_norm[strategy=FULL_SHARD,norm_type=2]",
                     "grad_clip/wrapper_clip_grad_norm[strategy=FULL_SHARD,norm_type=1]"))
    patches = (Patch("fsdp_impl.unit_methods:_grads", _shards_counted_whole),)


def _unclipped(clip: Fn) -> Fn:
    def norm_only(module: Any, max_norm: float, norm_type: float) -> Any:
        return clip(module, float("inf"), norm_type)

    return norm_only


class ClipScalesNothing(_Mutant):
    """``clip_grad_norm_`` returns the total norm but leaves the gradients as they were."""

    name = "mutant-clip-scales-nothing"
    breaks = "scaling the gradients to max_norm"
    expect = Expect("grad_clip and wrapper_clip_grad_norm", "process", ("grad_clip/wrapper_clip_grad_norm",))
    patches = (Patch("fsdp_impl.unit_methods:clip_grad_norm_", _unclipped),)
