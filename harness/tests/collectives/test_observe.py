"""[Note: observing collectives]: every layer's collectives are recorded once, and the comm worker defers them."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import harness
from harness.collectives.comm_worker import comm_worker

MODES = ["process", "thread"]


def _every_layer(ctx: harness.RankContext) -> list[str]:
    """One call per spelling; each line of the result is what the recorder saw for it."""
    ws, group = ctx.world_size, dist.group.WORLD
    assert group is not None
    calls = {
        "_all_gather_base": lambda: dist._all_gather_base(torch.empty(2 * ws), torch.ones(2)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * ws)),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)]),
        "functional all_gather": lambda: funcol.wait_tensor(
            torch.ops._c10d_functional.all_gather_into_tensor(torch.ones(2), ws, group.group_name)),
        "functional reduce_scatter avg": lambda: funcol.wait_tensor(
            torch.ops._c10d_functional.reduce_scatter_tensor(torch.ones(2 * ws), "avg", ws, group.group_name)),
        "functional autograd all_gather": lambda: funcol.wait_tensor(
            torch.ops._c10d_functional_autograd.all_gather_into_tensor(torch.ones(2, requires_grad=True), ws,
                                                                       group.group_name)),
        "DTensor distribute_tensor, full_tensor": lambda: _full_tensor(ctx),
    }
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for label, call in calls.items():
            with ctx.record_collectives() as trace:
                call()
            seen.append(f"{label}: {trace.render()} [{','.join(c.layer for c in trace.calls)}]")
    return seen


def _full_tensor(ctx: harness.RankContext) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = ctx.device_mesh((ctx.world_size,))
    shard = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    with ctx.record_collectives() as inner:  # nested: the outer trace sees the same call once
        shard.full_tensor()
    assert [c.op for c in inner.calls] == ["all_gather_into_tensor"], inner.render()


@pytest.mark.parametrize("mode", MODES)
def test_each_spelling_is_recorded_once(mode: str) -> None:
    seen = harness.run(_every_layer, world_size=2, mode=mode)[0]
    python_or_c10d = "torch.distributed" if mode == "thread" else "c10d"
    assert seen == [
        f"_all_gather_base: all_gather_into_tensor group=[0, 1] float32 8B [{python_or_c10d}]",
        f"reduce_scatter_tensor: reduce_scatter_tensor SUM group=[0, 1] float32 16B [{python_or_c10d}]",
        f"all_reduce_coalesced: all_reduce SUM group=[0, 1] float32 20B [{python_or_c10d}]",
        "functional all_gather: all_gather_into_tensor group=[0, 1] float32 8B async [functional]",
        "functional reduce_scatter avg: reduce_scatter_tensor AVG group=[0, 1] float32 16B async [functional]",
        "functional autograd all_gather: all_gather_into_tensor group=[0, 1] float32 8B async [functional]",
        "DTensor distribute_tensor, full_tensor: scatter group=[0, 1] float32 48B\n"
        f"all_gather_into_tensor group=[0, 1] float32 24B async [{python_or_c10d},functional]",
    ]


def _direct_and_coalesced(ctx: harness.RankContext) -> str:
    """Process ranks only: direct c10d ops and a coalescing manager need a C++ group."""
    ws, group = ctx.world_size, dist.group.WORLD
    with ctx.record_collectives() as trace:
        reduce_op = dist.ReduceOp.SUM
        _, work = torch.ops.c10d.allreduce_([torch.ones(3)], group.boxed(), reduce_op.boxed() if hasattr(
            reduce_op, "boxed") else torch.classes.c10d.ReduceOp(), None, False)
        dist.distributed_c10d.Work.unbox(work).wait()
        outs = [torch.empty(2 * ws), torch.empty(4 * ws)]
        with dist._coalescing_manager(group, async_ops=True) as manager:
            dist.all_gather_into_tensor(outs[0], torch.ones(2))
            dist.all_gather_into_tensor(outs[1], torch.ones(4))
        manager.wait()
    return trace.render()


def test_direct_c10d_op_and_coalescing_manager_are_one_collective_each() -> None:
    assert harness.run(_direct_and_coalesced, world_size=2, mode="process")[0].splitlines() == [
        "all_reduce SUM group=[0, 1] float32 12B",
        "all_gather_into_tensor group=[0, 1] float32 24B async",
    ]


def _functional_overlaps(ctx: harness.RankContext) -> dict[str, object]:
    group = dist.group.WORLD
    with comm_worker(comm_ms=100) as worker:
        start = time.perf_counter()
        out = torch.ops._c10d_functional.all_gather_into_tensor(torch.full((2,), float(ctx.rank)), 2,
                                                                group.group_name)
        issued_s = time.perf_counter() - start
        time.sleep(0.1)  # "compute" while the all-gather is in flight
        gathered = funcol.wait_tensor(out).tolist()
        overlapped_s = time.perf_counter() - start
    return {"issued_s": issued_s, "overlapped_s": overlapped_s, "gathered": gathered,
            "ops": [e.op for e in worker.timeline]}


@pytest.mark.timing  # bounds measured durations: alone under -n
def test_worker_defers_functional_collectives_until_wait_tensor() -> None:
    for result in harness.run(_functional_overlaps, world_size=2, mode="process"):
        assert result["issued_s"] < 0.05, "a functional collective must return its output at once"
        assert 0.1 <= result["overlapped_s"] < 0.19, "100 ms comm behind 100 ms compute should take ~100 ms"
        assert result["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert result["ops"] == ["all_gather_into_tensor"]


def _nested(ctx: harness.RankContext) -> tuple[int, int]:
    with ctx.record_collectives() as outer:
        with ctx.record_collectives() as inner:
            dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1))  # after the inner block: still the outer block's
    return len(inner.calls), outer.count("all_reduce")


@pytest.mark.parametrize("mode", MODES)
def test_an_inner_block_hands_collectives_back_to_the_outer_one(mode: str) -> None:
    inner, outer = harness.run(_nested, world_size=2, mode=mode)[0]
    assert inner == 1
    assert outer >= 1, "the outer block lost its collectives when the inner one ended"
