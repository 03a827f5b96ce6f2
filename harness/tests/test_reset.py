"""Per-case reset: DTensor caches keyed by value-equal meshes do not leak destroyed groups.

See [Note: mesh-keyed caches] in ``harness/reset.py``. Each case below builds
the same 1-D mesh over a group of its own, so the meshes of consecutive cases
are equal (same ranks, device type, names) but backed by different groups, and
the earlier case's group is destroyed by the reset.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import harness
from harness import reset


def _op_then_gather(ctx: harness.RankContext) -> list[float]:
    group = ctx.new_group(range(ctx.world_size))
    mesh = DeviceMesh.from_group(group, ctx.device.type)
    shard = DTensor.from_local(torch.full((2,), float(ctx.rank)), mesh, [Shard(0)], run_check=False)
    out = shard + 1.0  # a new DTensor whose spec (and so its mesh) may come from a cache
    return out.full_tensor().tolist()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_equal_mesh_over_a_new_group_works_in_the_next_case(mode: str) -> None:
    expected = [[1.0, 1.0, 2.0, 2.0]] * 2
    for _ in range(3):  # the same pool: every run after the first reuses its ranks
        assert harness.run(_op_then_gather, world_size=2, mode=mode) == expected


def test_the_caches_it_clears_exist() -> None:
    """The reset reaches into torch internals; a torch upgrade that moves them must fail here."""
    import torch.distributed.tensor  # the reset only clears once DTensor is loaded

    reset.clear_mesh_keyed_caches()
    assert torch._C._get_DTensor_sharding_propagator_cache_stats() is not None
