"""Hybrid-mesh mutants: gradients of replicas left unreduced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["ReplicasNotAllReduced"]


def _skip_replicate_all_reduce(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``start_all_reduce`` that leaves a hybrid unit's gradient as its own replica computed it."""

    def start(unit: Any, grad: Any) -> Any:
        if unit.groups.inter_node_pg is None:
            return original(unit, grad)
        from fsdp_impl import collectives
        from fsdp_impl.unit_state import Reduction

        return Reduction(unit, collectives.Pending(None, grad), "done")

    return start


class ReplicasNotAllReduced(_Mutant):
    """Hybrid units reduce gradients within their shard group only, never across replicas."""

    name = "mutant-replicas-not-all-reduced"
    breaks = "all-reducing hybrid gradients over the replicate group"
    # A shape with one replica (4x1, every rank on the shard dim) has nothing to all-reduce, so it passes.
    expect = Expect(
        "(replicas_match_baseline and not 4x1) or (mesh_dims and positional and replicate)", "thread",
        ("hybrid_meshes/replicas_match_baseline[shape=2x2]", "hybrid_meshes/replicas_match_baseline[shape=1x4]",
         "fully_shard_api/mesh_dims[select=positional,ranks_on=replicate]"),
    )
    patches = (Patch("fsdp_impl.reduction:start_all_reduce", _skip_replicate_all_reduce),)
