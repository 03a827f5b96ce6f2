"""The xdist scheduler's timing phase, driven by fake workers that behave like xdist's.

A fake worker runs the tests it was sent in order, but (like a real one)
keeps the last one until it knows what comes next or is told to shut down;
a worker that was told to shut down and has run everything leaves, and the
scheduler hears of it through ``remove_node``, as from xdist's controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from conformance.runner.settings import SettingError, resolve_settings
from harness.plugin.scheduling import TimingLastScheduling
from harness.plugin.workers import auto_workers
from harness.setting_sources import Resolved


@dataclass(eq=False)
class FakeWorker:
    name: str
    queue: list[int] = field(default_factory=list)
    shutting_down: bool = False

    @property
    def gateway(self) -> SimpleNamespace:
        return SimpleNamespace(id=self.name)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True

    def runnable(self) -> bool:
        return len(self.queue) >= 2 or (self.shutting_down and bool(self.queue))


class FakeConfig:
    def __init__(self, workers: int) -> None:
        self.workers = workers

    def getvalue(self, name: str) -> list[str]:
        assert name == "tx"
        return [f"{self.workers}*popen"]

    def getoption(self, name: str) -> None:
        return None


def _run(collection: list[str], timing: set[int], workers: int) -> list[tuple[str, object]]:
    """Drive a session to its end; the events in order: ("ran", (worker, index)) and ("left", worker)."""
    sched = TimingLastScheduling(FakeConfig(workers), None, lambda node: sorted(timing))  # type: ignore[arg-type]
    nodes = [FakeWorker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    events: list[tuple[str, object]] = []
    live = list(nodes)
    while live:
        done = next((n for n in live if n.shutting_down and not n.queue), None)
        if done is not None:
            live.remove(done)
            events.append(("left", done.name))
            assert sched.remove_node(done) is None
            continue
        node = next((n for n in live if n.runnable()), None)
        if node is None:
            raise AssertionError(f"stalled: queues {[(n.name, n.queue) for n in live]}, held {sched.held}")
        index = node.queue.pop(0)
        events.append(("ran", (node.name, index)))
        sched.mark_test_complete(node, index)
    assert sched.tests_finished
    return events


def _check_timing_phase(events: list[tuple[str, object]], timing: set[int]) -> str:
    """Timing tests ran last, all on one worker, after every other worker left; returns that worker."""
    ran = [value for kind, value in events if kind == "ran"]
    first = next(i for i, (_, index) in enumerate(ran) if index in timing)  # type: ignore[misc]
    assert all(index in timing for _, index in ran[first:]), ran  # type: ignore[misc]
    workers = {worker for worker, index in ran[first:]}  # type: ignore[misc]
    assert len(workers) == 1, ran
    (alone,) = workers
    start = events.index(("ran", ran[first]))
    left_before = {value for kind, value in events[:start] if kind == "left"}
    everyone = {worker for worker, _ in ran} - {alone}  # type: ignore[misc]
    assert everyone <= left_before, (events, everyone, left_before)
    return str(alone)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_timing_tests_run_last_alone_on_one_worker(workers: int) -> None:
    collection = [f"t{i}" for i in range(20)]
    timing = {3, 4, 11}
    events = _run(collection, timing, workers)
    ran = sorted(index for kind, (_, index) in ((k, v) for k, v in events if k == "ran"))  # type: ignore[misc]
    assert ran == list(range(20))
    _check_timing_phase(events, timing)


def test_only_timing_tests() -> None:
    events = _run(["a", "b"], {0, 1}, workers=2)
    _check_timing_phase(events, {0, 1})


def test_without_timing_tests_it_is_load_scheduling() -> None:
    events = _run([f"t{i}" for i in range(10)], set(), workers=2)
    assert sorted(v[1] for k, v in events if k == "ran") == list(range(10))  # type: ignore[index]


def test_a_crashed_timing_worker_hands_its_timing_tests_back() -> None:
    """The timing worker dies in its first timing test; a replacement would get the rest (here: none is left)."""
    collection = [f"t{i}" for i in range(8)]
    timing = {2, 5}
    sched = TimingLastScheduling(FakeConfig(1), None, lambda node: sorted(timing))  # type: ignore[arg-type]
    node = FakeWorker("gw0")
    sched.add_node(node)
    sched.add_node_collection(node, collection)
    sched.schedule()
    while node.queue and node.queue[0] not in timing:
        index = node.queue.pop(0)
        sched.mark_test_complete(node, index)
    assert node.queue[0] == 2 and sched.held == []
    node.queue.clear()
    assert sched.remove_node(node) == "t2"
    assert sched.held == [5] and sched.pending == [] and not sched.tests_finished
    replacement = FakeWorker("gw1")
    sched.add_node(replacement)
    sched.add_node_collection(replacement, collection)
    sched.schedule()
    assert replacement.queue == [5] and replacement.shutting_down and sched.held == []


def test_auto_workers_fit_the_cores() -> None:
    assert [auto_workers(c) for c in (1, 2, 3, 4, 8, 16)] == [0, 2, 2, 2, 4, 8]
    with pytest.raises(ValueError, match="cores and ranks_per_case must be >= 1, got 0 and 2"):
        auto_workers(0)


def test_worker_count_setting_names_its_source() -> None:
    mode = Resolved("rank mode", "both", "default")
    assert resolve_settings({"workers": ("-n", "auto")}, rank_mode=mode, env={}).workers.describe() == \
        "workers: auto (from -n)"
    assert resolve_settings({}, rank_mode=mode, env={}).workers.value == 0
    with pytest.raises(SettingError, match=r"-n='two': expected auto or a whole number >= 0"):
        resolve_settings({"workers": ("-n", "two")}, rank_mode=mode, env={})


def test_a_timing_case_carries_the_timing_mark() -> None:
    from conformance.cases import test_overlap
    from conformance.contract.case import case

    @case("demo/timed", timing=True)
    def timed(ctx: object, impl: object) -> None: ...

    @case("demo/untimed")
    def untimed(ctx: object, impl: object) -> None: ...

    def marks(fn: object) -> set[str]:
        return {m.name for m in getattr(fn, "pytestmark", [])}

    assert "timing" in marks(timed) and "timing" not in marks(untimed)
    assert "timing" in marks(test_overlap.test_training_overlap)
    assert "timing" in marks(test_overlap.test_no_overlap_detected)
