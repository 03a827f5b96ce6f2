"""The communication worker: issue order, handle semantics, delay, overlap, clean shutdown."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import harness
from harness.collectives.comm_worker import comm_worker
from harness.tests import compat


def _async_overlaps_sync_does_not(ctx: harness.RankContext) -> dict[str, float]:
    threads_before = threading.active_count()
    with comm_worker(comm_ms=100) as worker:
        start = time.perf_counter()
        work = dist.all_reduce(torch.ones(1), async_op=True)
        issued_s = time.perf_counter() - start
        time.sleep(0.1)  # "compute" while the collective is in flight
        work.wait()
        overlapped_s = time.perf_counter() - start
        start = time.perf_counter()
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)
        blocking_s = time.perf_counter() - start
        out = torch.empty(2)
        h1 = compat.all_gather_single(out, torch.full((1,), float(ctx.rank)), async_op=True)
        h2 = dist.all_reduce(torch.ones(1), async_op=True)
        h2.wait()
        completed_first = h1.is_completed()
        h1.wait()
    ops = [e.op for e in worker.timeline]
    ordered = all(a.ended_ms <= b.started_ms + 1e-6 for a, b in zip(worker.timeline, worker.timeline[1:], strict=False))
    return {"issued_s": issued_s, "overlapped_s": overlapped_s, "blocking_s": blocking_s,
            "in_order": float(ordered and completed_first), "gathered": out.tolist(),
            "ops": ops, "threads_leaked": threading.active_count() - threads_before}


@pytest.mark.timing  # bounds measured durations: alone under -n
def test_worker_semantics_on_process_ranks() -> None:
    for result in harness.run(_async_overlaps_sync_does_not, world_size=2, mode="process"):
        assert result["issued_s"] < 0.05, "an async collective must return a handle at once"
        assert 0.1 <= result["overlapped_s"] < 0.19, "async collective + 100 ms compute should take ~100 ms"
        assert result["blocking_s"] >= 0.2, "a blocking collective cannot overlap the compute after it"
        assert result["in_order"] == 1.0, "the worker must run collectives one at a time in issue order"
        assert result["gathered"] == [0.0, 1.0]
        assert result["ops"] == ["all_reduce", "all_reduce", "all_gather_into_tensor", "all_reduce"]
        assert result["threads_leaked"] == 0


def _old_and_new_names(ctx: harness.RankContext) -> dict[str, object]:
    """Deprecated names pass async_op positionally; every spelling must behave alike."""
    import warnings

    calls = {
        "_all_gather_base positional async": lambda out, inp: dist._all_gather_base(out, inp, None, True),
        "all_gather_into_tensor keyword async": lambda out, inp: dist.all_gather_into_tensor(out, inp, async_op=True),
        "_reduce_scatter_base positional async":
            lambda out, inp: dist._reduce_scatter_base(out, inp, dist.ReduceOp.SUM, None, True),
        "reduce_scatter_tensor keyword async": lambda out, inp: dist.reduce_scatter_tensor(out, inp, async_op=True),
    }
    results: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with comm_worker(comm_ms=100):
            for label, call in calls.items():
                gather = "gather" in label
                out = torch.empty(2 if gather else 1)
                inp = torch.full((1 if gather else 2,), float(ctx.rank + 1))
                start = time.perf_counter()
                handle = call(out, inp)
                issued_s = time.perf_counter() - start
                handle.wait()
                results[label] = (issued_s < 0.05, out.tolist())
            start = time.perf_counter()
            out = torch.empty(2)
            assert dist._all_gather_base(out, torch.ones(1), None, False) is None
            results["_all_gather_base positional sync blocks"] = time.perf_counter() - start >= 0.1
    return results


def test_worker_binds_collectives_by_signature_old_and_new_names() -> None:
    for result in harness.run(_old_and_new_names, world_size=2, mode="process"):
        assert result["_all_gather_base positional async"] == (True, [1.0, 2.0])
        assert result["all_gather_into_tensor keyword async"] == (True, [1.0, 2.0])
        assert result["_reduce_scatter_base positional async"] == (True, [3.0])
        assert result["reduce_scatter_tensor keyword async"] == (True, [3.0])
        assert result["_all_gather_base positional sync blocks"] is True
