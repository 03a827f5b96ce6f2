"""Mesh mutants: gradients of replicas left unreduced; a tensor-parallel dim taken for data parallelism."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch.nn as nn

from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["ReplicasNotAllReduced", "TensorParallelDimTakenForData"]


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


class TensorParallelDimTakenForData(TorchFSDP2Adapter):
    """torch-fsdp2 whose ``fully_shard`` takes a tensor-parallel dim for data parallelism: given a submesh it shards
    over the whole mesh it was cut from, and ``dp_mesh_dims`` without a replicate dim get the mesh's other dim as one
    (the tensor-parallel parameters' placements on it are then refused)."""

    name = "mutant-fsdp2-tensor-parallel-dim-taken-for-data"
    breaks = "sharding tensor-parallel parameters over the data-parallel dim of a (dp, tp) mesh"
    # Only torch-fsdp2 composes with tensor parallelism, so this mutant derives from its adapter; the reference's
    # rows are n/a (the rows also kill generated mutants of torch's own code: docs/PERFORMANCE.md).
    expect: ClassVar[Expect] = Expect("tensor_parallel", "thread", ("fully_shard_api/tensor_parallel",))

    def fully_shard(self, module: nn.Module | Sequence[nn.Module], *, mesh: Any, dp_mesh_dims: Any = None,
                    **kwargs: Any) -> nn.Module:
        if dp_mesh_dims is not None and dp_mesh_dims[1] is None:
            dp_mesh_dims = (dp_mesh_dims[0], next(name for name in mesh.mesh_dim_names if name != dp_mesh_dims[0]))
        elif dp_mesh_dims is None:
            mesh = mesh._get_root_mesh()
        return super().fully_shard(module, mesh=mesh, dp_mesh_dims=dp_mesh_dims, **kwargs)
