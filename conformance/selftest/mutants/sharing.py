"""Mutants about parameters shared between modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["SharedAcrossUnitsAccepted", "PaddedRankGradsDropped"]

Fn = Callable[..., Any]


class SharedAcrossUnitsAccepted(_Mutant):
    """Accepts a parameter tied across two units without the unit-level check that rejects it."""

    name = "mutant-shared-across-units-accepted"
    breaks = "rejecting (or correctly training) weights tied across units"
    # With flat parameters the unchecked reference happens to keep the tie and train
    # correctly (the case accepts that); with original parameters it does not.
    expect = Expect(
        "uneven_shared and across_units", "thread", ("uneven_shared/train[tie=across_units]",),
    )
    patches = (Patch.instead("fsdp_impl.init:check_not_shared_with_nested", lambda root, params: None),)


def _drop_on_padded_rank(accumulate: Fn) -> Fn:
    def accumulate_unless_padded_rank(handle: Any, grad: Any) -> None:
        padded = handle.padded_numel != handle.numel
        if not (padded and handle.shard_rank == handle.shard_size - 1):
            accumulate(handle, grad)

    return accumulate_unless_padded_rank


class PaddedRankGradsDropped(_Mutant):
    """The rank whose shard ends in padding never receives its rows' gradients."""

    name = "mutant-padded-rank-grads-dropped"
    breaks = "training the rows of the rank that holds a unit's padding"
    expect = Expect("uneven_shared and within_unit", "thread", ("uneven_shared/train[tie=within_unit]",))
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.accumulate_sharded_grad", _drop_on_padded_rank),)
