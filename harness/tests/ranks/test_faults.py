"""Every fault kind is detected, attributed to the right rank and kind, within bounds."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import harness

MODES = ["process", "thread"]
#: A rank's death must be seen within this long (the harness waits on process sentinels).
DEATH_BOUND_S = 2.0
#: Slack over timeout_s for reporting a hang (stack collection and teardown).
HANG_SLACK_S = 5.0


def _raise_on_rank_1(ctx: harness.RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError(f"bad shard on rank {ctx.rank}")
    dist.barrier()  # rank 0 blocks here until the harness tears the run down


@pytest.mark.parametrize("mode", MODES)
def test_raise_is_attributed_to_the_raising_rank(mode: str) -> None:
    with pytest.raises(harness.RankRaised) as info:
        harness.run(_raise_on_rank_1, world_size=2, mode=mode, timeout_s=30)
    exc = info.value
    assert exc.rank == 1 and exc.kind == "raised"
    first_line = str(exc).splitlines()[0]
    assert first_line == f"rank 1 raised ValueError: bad shard on rank 1 (world_size=2, mode={mode})"
    assert "_raise_on_rank_1" in exc.failures[0].traceback
    assert [f.kind for f in exc.failures[1:]] == ["aborted"], "rank 0 only waited; it must not be blamed"


def _mark_death(stamp: str | None) -> None:
    if stamp:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))


def _exit_on_rank_1(ctx: harness.RankContext, stamp: str | None = None) -> None:
    if ctx.rank == 1:
        _mark_death(stamp)
        os._exit(3)
    dist.barrier()


def _sigkill_on_rank_0(ctx: harness.RankContext, stamp: str | None = None) -> None:
    if ctx.rank == 0:
        _mark_death(stamp)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _segfault_on_rank_1(ctx: harness.RankContext, stamp: str | None = None) -> None:
    if ctx.rank == 1:
        _mark_death(stamp)
        ctypes.string_at(0)
    dist.barrier()


_DEATHS = [
    pytest.param(_exit_on_rank_1, 1, 3, None, "process", id="os_exit-process"),
    pytest.param(_sigkill_on_rank_0, 0, -signal.SIGKILL, "SIGKILL", "process", id="sigkill-process"),
    pytest.param(_segfault_on_rank_1, 1, -signal.SIGSEGV, "SIGSEGV", "process", id="segfault-process"),
    # A thread rank takes its thread host down; the host names the rank ([Note: thread host]).
    pytest.param(_exit_on_rank_1, 1, 3, None, "thread", id="os_exit-thread"),
    pytest.param(_segfault_on_rank_1, 1, -signal.SIGSEGV, "SIGSEGV", "thread", id="segfault-thread"),
]


@pytest.mark.parametrize(("body", "rank", "exitcode", "signal_name", "mode"), _DEATHS)
@pytest.mark.timing  # an upper bound on detection latency: alone under -n
def test_death_is_detected_fast_and_named(
    body, rank: int, exitcode: int, signal_name: str | None, mode: str, tmp_path
) -> None:
    stamp = tmp_path / "death"
    with pytest.raises(harness.RankDied) as info:
        harness.run(body, world_size=2, mode=mode, timeout_s=60, args=(str(stamp),))
    exc = info.value
    assert exc.rank == rank and exc.kind == "died"
    assert exc.failures[0].exitcode == exitcode
    assert exc.failures[0].signal_name == signal_name
    assert str(exc).startswith(f"rank {rank} died (")
    if mode == "thread":
        assert "thread host" in exc.failures[0].summary and "unknown" not in exc.failures[0].summary
        assert [(f.rank, f.kind) for f in exc.failures[1:]] == [(1 - rank, "aborted")]
    # From the moment the rank was about to die to the moment the parent saw it.
    latency = exc.failures[0].detected_at - float(stamp.read_text())
    assert 0 <= latency < DEATH_BOUND_S, f"death seen after {latency:.2f} s"
    if signal_name == "SIGSEGV":
        assert "_segfault_on_rank_1" in exc.failures[0].stack, "faulthandler's crash stack is missing"
    # The run goes on: the next case passes (a fresh pool or thread host).
    assert harness.run(_noop, world_size=2, mode=mode) == [0, 1]


def _noop(ctx: harness.RankContext) -> int:
    return ctx.rank


def test_a_death_names_the_tasks_its_process_ran_before() -> None:
    """A task that ended cleanly can leave its process broken for a later one, so a death names what ran before
    it in the same pool ([Note: process pool lifecycle])."""
    assert harness.run(_noop, world_size=2, mode="process") == [0, 1]
    with pytest.raises(harness.RankDied) as info:
        harness.run(_segfault_on_rank_1, world_size=2, mode="process", timeout_s=60)
    summary = info.value.failures[0].summary
    assert summary.startswith("process exited without reporting a result; its process had run "), summary
    assert "test_a_death_names_the_tasks_its_process_ran_before (_noop) (an earlier task" in summary, summary
    # A fresh pool has run nothing before: its death names no earlier task.
    with pytest.raises(harness.RankDied) as info:
        harness.run(_segfault_on_rank_1, world_size=2, mode="process", timeout_s=60)
    assert info.value.failures[0].summary == "process exited without reporting a result"


def _rank_1_skips_a_collective(ctx: harness.RankContext) -> None:
    if ctx.rank != 1:
        dist.all_reduce(torch.ones(1))


@pytest.mark.timing  # an upper bound on the time to report: alone under -n
@pytest.mark.parametrize("mode", MODES)
def test_hang_is_reported_at_the_timeout_with_stacks(mode: str) -> None:
    harness.run(_noop, world_size=2, mode=mode)
    timeout_s = 3.0
    start = time.monotonic()
    with pytest.raises(harness.RankFailure) as info:
        harness.run(_rank_1_skips_a_collective, world_size=2, mode=mode, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert timeout_s <= elapsed < timeout_s + HANG_SLACK_S, f"took {elapsed:.2f} s"
    exc = info.value
    # Rank 0 timed out, but waiting for rank 1 ([Note: collective mismatch] in harness.collectives.sequence).
    assert exc.rank == 1 and exc.kind == "collective"
    assert (exc.failures[1].rank, exc.failures[1].kind) == (0, "aborted")
    assert "rank 0 timed out: no result after 3 s" in exc.failures[1].summary
    assert "_rank_1_skips_a_collective" in exc.failures[1].stack
    assert str(exc).startswith(f"rank 1 did not reach all_reduce #1, which rank 0 waits in (it returned after "
                               f"0 collectives) (world_size=2, mode={mode})")
    # The next run still works (a fresh pool in process mode).
    assert harness.run(_noop, world_size=2, mode=mode) == [0, 1]


def _sleep_forever_on_rank_0(ctx: harness.RankContext) -> None:
    if ctx.rank == 0:
        while True:
            time.sleep(0.05)


def test_thread_rank_outside_a_collective_is_stopped_at_the_timeout() -> None:
    with pytest.raises(harness.RankTimedOut) as info:
        harness.run(_sleep_forever_on_rank_0, world_size=2, mode="thread", timeout_s=1.0)
    assert info.value.rank == 0
    assert "could not be stopped" not in str(info.value)
    assert "_sleep_forever_on_rank_0" in info.value.failures[0].stack


def test_a_death_outranks_the_connection_errors_it_causes() -> None:
    from harness.ranks.errors import RankError, make_failure

    arrivals = [
        RankError(1, "raised", "RuntimeError: Connection reset by peer"),
        RankError(0, "died", "process exited without reporting a result", signal_name="SIGKILL"),
        RankError(2, "aborted", "did not finish after rank 0 failed"),
    ]
    failure = make_failure(arrivals, world_size=3, mode="process")
    assert isinstance(failure, harness.RankDied) and failure.rank == 0
    assert [f.rank for f in failure.failures] == [0, 1, 2]
