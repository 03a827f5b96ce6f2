"""Collective recording: counts, groups, bytes, a stable rendering, delay and failure injection."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from expecttest import TestCase

import harness

MODES = ["process", "thread"]


def _traffic(ctx: harness.RankContext) -> str:
    pair = ctx.new_group([0, 1])
    with ctx.record_collectives() as trace:
        shard = torch.ones(3)
        full = torch.empty(3 * ctx.world_size)
        dist.all_gather_into_tensor(full, shard)
        out = torch.empty(3)
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM)
        work = dist.all_reduce(torch.ones(2, dtype=torch.float64), group=pair, async_op=True)
        work.wait()
        dist.broadcast(torch.zeros(4), src=0)
        gathered = [torch.empty(1) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, torch.ones(1))
    assert trace.count("all_reduce", group_ranks=[0, 1]) == 1
    assert trace.count("all_reduce", group_ranks=[0, 1, 2]) == 0
    assert trace.bytes("reduce_scatter_tensor") == 3 * ctx.world_size * 4
    return trace.render()


class TestTrace(TestCase):
    def test_render_is_stable_and_identical_in_both_modes(self) -> None:
        rendered = {mode: harness.run(_traffic, world_size=2, mode=mode) for mode in MODES}
        assert rendered["process"] == rendered["thread"]
        self.assertExpectedInline(
            rendered["process"][1],
            """\
all_gather_into_tensor group=[0, 1] float32 12B
reduce_scatter_tensor SUM group=[0, 1] float32 24B
all_reduce SUM group=[0, 1] float64 16B async
broadcast group=[0, 1] float32 16B
all_gather group=[0, 1] float32 4B""",
        )


def _delayed(ctx: harness.RankContext) -> float:
    with ctx.record_collectives(delay_s=0.2):
        start = time.perf_counter()
        dist.all_reduce(torch.ones(1))
        return time.perf_counter() - start


@pytest.mark.parametrize("mode", MODES)
def test_delay_is_applied_before_each_collective(mode: str) -> None:
    assert all(t >= 0.2 for t in harness.run(_delayed, world_size=2, mode=mode))


def _injected_failure(ctx: harness.RankContext) -> None:
    with ctx.record_collectives(fail="all_reduce" if ctx.rank == 0 else None):
        dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("mode", MODES)
def test_failure_injection_names_the_rank_and_restores_collectives(mode: str) -> None:
    with pytest.raises(harness.RankRaised, match=r"^rank 0 raised RuntimeError: injected failure in all_reduce"):
        harness.run(_injected_failure, world_size=2, mode=mode, timeout_s=30)
    assert harness.run(_still_patched, world_size=2, mode=mode) == [False, False]


def _still_patched(ctx: harness.RankContext) -> bool:
    """An interceptor of an earlier block still sees this rank's collectives (ranks keep a counting
    observer installed between blocks, [Note: collective mismatch]; it intercepts nothing)."""
    from harness.collectives.recorder import intercepting

    return intercepting()


def test_patch_is_removed_after_the_block() -> None:
    for mode in MODES:
        harness.run(_traffic, world_size=2, mode=mode)
        assert harness.run(_still_patched, world_size=2, mode=mode) == [False, False]


def test_require_names_what_was_not_seen() -> None:
    trace = harness.Trace([harness.Call("all_gather_into_tensor", (0, 1), 8, "float32", None, False)])
    assert trace.require({"all_gather_into_tensor"}, "forward") == trace.calls
    with pytest.raises(AssertionError, match=r"^backward: no all_reduce/reduce_scatter_tensor was observed, so no "
                                             r"collective of this implementation can be checked .*1 other call"):
        trace.require({"all_reduce", "reduce_scatter_tensor"}, "backward")


def _names(ctx: harness.RankContext) -> list[bool]:
    first, second = ctx.new_group([0, 1]), ctx.new_group([0, 1])
    with ctx.record_collectives() as trace:
        dist.all_reduce(torch.ones(1), group=first)
        dist.all_reduce(torch.ones(1), group=second)
        dist.all_reduce(torch.ones(1))
    one, two, world = trace.calls
    return [one.group_ranks == two.group_ranks, one.group_name == first.group_name,
            two.group_name == second.group_name, one.group_name != two.group_name,
            world.group_name == dist.group.WORLD.group_name]


@pytest.mark.parametrize("mode", MODES)
def test_calls_tell_two_groups_of_the_same_ranks_apart(mode: str) -> None:
    """Each call carries its group's c10d name: two groups made with the same ranks differ by it."""
    assert harness.run(_names, world_size=2, mode=mode) == [[True] * 5] * 2
