"""A rank that skips or swaps a collective is blamed, not the ranks left waiting ([Note: collective mismatch])."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import harness
from harness.collectives.sequence import Position, attributed, blame
from harness.ranks import thread_host
from harness.ranks.errors import CollectiveMismatch, RankError, RankTimedOut

MODES = ["process", "thread"]
TIMEOUT_S = 5.0
#: Slack over the timeout for reporting a hang (stack collection and teardown), as for any hang.
HANG_SLACK_S = 5.0


def _noop(ctx: harness.RankContext) -> None:
    dist.barrier()


def _rank_1_skips_the_second(ctx: harness.RankContext) -> None:
    t = torch.ones(2)
    dist.all_reduce(t)
    if ctx.rank != 1:
        dist.all_reduce(t)


def _rank_1_skips_the_first(ctx: harness.RankContext) -> None:
    t = torch.ones(1)
    if ctx.rank != 1:
        dist.all_reduce(t)
    gathered = [torch.zeros(1) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, t)


def _timed_failure(body: Callable[[harness.RankContext], None], mode: str) -> tuple[CollectiveMismatch, float]:
    harness.run(_noop, world_size=2, mode=mode, timeout_s=60)  # ranks started: time the case alone
    start = time.monotonic()
    with pytest.raises(CollectiveMismatch) as info:
        harness.run(body, world_size=2, mode=mode, timeout_s=TIMEOUT_S)
    return info.value, time.monotonic() - start


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_returns_before_a_collective_is_blamed(mode: str) -> None:
    harness.run(_noop, world_size=2, mode=mode, timeout_s=60)
    warm_host = thread_host._hosts.get("cpu")
    exc, elapsed = _timed_failure(_rank_1_skips_the_second, mode)
    assert str(exc).splitlines()[0] == (f"rank 1 did not reach all_reduce #2, which rank 0 waits in (it returned "
                                        f"after 1 collective) (world_size=2, mode={mode})")
    assert [(f.rank, f.kind) for f in exc.failures] == [(1, "collective"), (0, "aborted")]
    assert "waiting in all_reduce #2 for rank 1" in exc.failures[1].summary
    assert elapsed < TIMEOUT_S + HANG_SLACK_S
    if mode == "thread":  # rank 0's thread may still wait in the collective: its host is not reused
        assert thread_host._hosts.get("cpu") is not warm_host
    assert harness.run(_noop, world_size=2, mode=mode, timeout_s=60) == [None, None]


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_calls_another_collective_is_blamed(mode: str) -> None:
    exc, elapsed = _timed_failure(_rank_1_skips_the_first, mode)
    head = str(exc).splitlines()[0]
    assert head == (f"rank 1 called all_gather as collective #1 where rank 0 called all_reduce "
                    f"(world_size=2, mode={mode})")
    assert "AttributeError" not in head and "IndexError" not in head
    assert exc.rank == 1
    assert elapsed < TIMEOUT_S + HANG_SLACK_S


def _at(rank: int, calls: int, op: str = "all_reduce", inside: bool = True) -> Position:
    return Position(rank, calls, op, inside)


def test_blame_rules() -> None:
    assert blame({0: _at(0, 3), 1: _at(1, 3)}, returned=set()) is None, "all wait in the same collective"
    behind = blame({0: _at(0, 4), 1: _at(1, 3, inside=False), 2: _at(2, 4)}, returned=set())
    assert behind is not None and list(behind.culprits) == [1] and behind.waiting == (0, 2)
    assert "it is outside any collective after 3 collectives" in behind.culprits[1]
    majority = blame({0: _at(0, 2, "broadcast"), 1: _at(1, 2), 2: _at(2, 2)}, returned=set())
    assert majority is not None and list(majority.culprits) == [0]
    assert majority.culprits[0] == "called broadcast as collective #2 where ranks [1, 2] called all_reduce"
    assert blame({0: _at(0, 1, inside=False), 1: _at(1, 1, inside=False)}, returned={0, 1}) is None


def test_a_rank_raising_outside_collectives_keeps_the_blame() -> None:
    """An exception outside any collective is the cause ([Note: failure attribution]); it is not reconsidered."""
    raised = harness.RankRaised([RankError(1, "raised", "ValueError: bad"), RankError(0, "aborted", "waiting")],
                                world_size=2, mode="process")
    positions = {0: _at(0, 2), 1: _at(1, 1, inside=False)}
    assert attributed(raised, positions) is raised
    timed_out = RankTimedOut([RankError(0, "timed_out", "no result after 5 s")], world_size=2, mode="process")
    assert isinstance(attributed(timed_out, positions), CollectiveMismatch)


def test_a_blamed_rank_that_raised_keeps_its_exception_in_the_blame() -> None:
    """Reconsidered for a peer that raised inside a collective, the rank behind it is blamed with what it raised."""
    failures = [RankError(0, "raised", "RuntimeError: aborted"), RankError(1, "raised", "ValueError: bad")]
    raised = harness.RankRaised(failures, world_size=2, mode="thread")
    found = attributed(raised, {0: _at(0, 2), 1: _at(1, 1, inside=False)})
    assert isinstance(found, CollectiveMismatch)
    assert str(found).splitlines()[0] == ("rank 1 did not reach all_reduce #2, which rank 0 waits in (it is outside "
                                          "any collective after 1 collective); it raised ValueError: bad "
                                          "(world_size=2, mode=thread)")
