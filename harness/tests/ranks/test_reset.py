"""Per-case reset: DTensor caches keyed by value-equal meshes do not leak destroyed groups.

See [Note: mesh-keyed caches] in ``harness/ranks/reset.py``. Each case below builds
the same 1-D mesh over a group of its own, so the meshes of consecutive cases
are equal (same ranks, device type, names) but backed by different groups, and
the earlier case's group is destroyed by the reset.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import harness
from harness.ranks import reset


def _op_then_gather(ctx: harness.RankContext) -> list[float]:
    group = dist.new_group(list(range(ctx.world_size)))  # the case's own, destroyed at its end
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


_patched: dict[str, int] = {"active": 0, "undone": 0}


def _undo() -> None:
    _patched["active"] = 0
    _patched["undone"] += 1


def _patch_for_this_case(ctx: harness.RankContext) -> int:
    reset.on_case_end(_undo)
    reset.on_case_end(_undo)  # registered once, however often
    _patched["active"] = 1
    ctx.barrier()  # every thread rank has patched before any could finish
    return _patched["undone"]


def _seen(ctx: harness.RankContext) -> tuple[int, int]:
    return _patched["active"], _patched["undone"]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_case_end_callbacks_undo_a_case_s_own_changes(mode: str) -> None:
    """A case's process-global change is undone when it ends: once per rank process, once per thread run."""
    before = harness.run(_patch_for_this_case, world_size=2, mode=mode)
    after = harness.run(_seen, world_size=2, mode=mode)
    assert after == [(0, before[0] + 1), (0, before[1] + 1)]


def _new_group_and_return(ctx: harness.RankContext) -> list[int]:
    ctx.all_ranks_equal("synchronised")  # both ranks start creating the group together
    return dist.get_process_group_ranks(ctx.new_group([0, 1]))


def test_a_group_made_just_before_the_case_ends_is_never_torn_down_mid_handshake() -> None:
    """[Note: groups outlive their handshake]: without the reset's barrier about 1 in 70 of these
    runs failed on a 2-core box (so 150 runs all passed by chance about 12 % of the time)."""
    failures = []
    for i in range(150):
        try:
            assert harness.run(_new_group_and_return, world_size=2, mode="process") == [[0, 1], [0, 1]]
        except harness.RankFailure as exc:
            failures.append(f"run {i}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures[:5])


def _group_of_two_in_four(ctx: harness.RankContext) -> int:
    """Ranks 2 and 3 take part in ``new_group`` but get no group of their own."""
    group = ctx.new_group([0, 1])
    return dist.get_world_size(group) if ctx.rank < 2 else 0


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_group_some_ranks_are_not_in_still_ends_the_case(mode: str) -> None:
    # Negative control (process ranks): with the barrier keyed on each rank's own group map, ranks 0 and 1
    # waited at the barrier for ranks 2 and 3, which skipped it, until the timeout.
    assert harness.run(_group_of_two_in_four, world_size=4, mode=mode, timeout_s=60) == [2, 2, 0, 0]
    assert harness.run(_group_of_two_in_four, world_size=4, mode=mode, timeout_s=60) == [2, 2, 0, 0]


def _groups_per_example(ctx: harness.RankContext) -> list[int]:
    """Five "examples" that each make a hybrid-like pair of groups inside ``groups_scope``; the group count
    and the process's threads before the first and after each."""
    import os


    seen = [len(c10d._world.pg_map) * 1000 + len(os.listdir(f"/proc/{os.getpid()}/task"))]  # before the first
    for _ in range(5):
        with harness.groups_scope():
            low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
            dist.all_reduce(torch.ones(1), group=low if ctx.rank < 2 else high)
            del low, high
        seen.append(len(c10d._world.pg_map) * 1000 + len(os.listdir(f"/proc/{os.getpid()}/task")))
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/<pid>/task (Linux)")
def test_groups_made_per_example_are_freed_with_their_threads() -> None:
    """[Note: groups made per example]: leaving the scope destroys its groups, and each gloo group's threads
    go with it, so every example leaves the rank as it was before the first (groups a previous case's context
    kept, [Note: kept groups], are counted in both)."""
    for seen in harness.run(_groups_per_example, world_size=4, mode="process"):
        assert len(set(seen)) == 1, f"groups*1000+threads before the first example and after each: {seen}"


def _kept_per_example(ctx: harness.RankContext) -> list[tuple[int, int, int]]:
    """Five examples asking the context for a pair of groups and a 2-D mesh: (groups, threads, distinct ids)."""
    import os

    seen, ids = [], set()
    for _ in range(5):
        with harness.groups_scope():
            low, high = ctx.new_group([0, 1]), ctx.new_group([2, 3])
            mesh = ctx.device_mesh((2, 2), ("replicate", "shard"))
            dist.all_reduce(torch.ones(1), group=low if ctx.rank < 2 else high)
            ids.add((id(low), id(high), id(mesh)))
        seen.append((len(c10d._world.pg_map), len(os.listdir(f"/proc/{os.getpid()}/task")), len(ids)))
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/<pid>/task (Linux)")
def test_groups_a_process_rank_keeps_are_reused_by_every_example() -> None:
    """[Note: kept groups]: the context's groups and meshes are made by the first example and handed to the
    next four, so nothing grows and every example gets the same objects."""
    for seen in harness.run(_kept_per_example, world_size=4, mode="process"):
        assert len(set(seen)) == 1 and seen[0][2] == 1, f"(groups, threads, distinct groups) after each: {seen}"


def _two_requests_then_sharded_op(ctx: harness.RankContext) -> tuple[bool, bool, list[float], Any]:
    first, second = ctx.new_group([0, 1]), ctx.new_group([0, 1])
    mesh = ctx.device_mesh((ctx.world_size,))
    before = torch._C._get_DTensor_sharding_propagator_cache_stats()  # (hits, misses)
    shard = DTensor.from_local(torch.full((2,), float(ctx.rank)), mesh, [Shard(0)], run_check=False)
    out = (shard * 3.0).full_tensor().tolist()
    after = torch._C._get_DTensor_sharding_propagator_cache_stats()
    stats = (after[0] - before[0], after[1] - before[1])
    return first is second, dist.get_process_group_ranks(second) == [0, 1], out, stats


def test_kept_groups_are_distinct_within_a_case_and_keep_dtensor_caches_warm() -> None:
    """Two requests for the same ranks in one case are two groups; a later case gets the same ones back, and
    a DTensor op the earlier case ran hits DTensor's cache (the reset cleared nothing: no group was destroyed)."""
    first = harness.run(_two_requests_then_sharded_op, world_size=2, mode="process")
    later = harness.run(_two_requests_then_sharded_op, world_size=2, mode="process")
    for same, ranks_ok, out, _ in first + later:
        assert not same and ranks_ok and out == [0.0, 0.0, 3.0, 3.0]
    assert all(stats == (1, 0) for *_, stats in later), f"(cache hits, misses) in the later case, per rank: {later}"
