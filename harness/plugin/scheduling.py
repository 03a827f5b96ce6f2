"""Running tests on pytest-xdist workers, with timing tests alone at the end.

Loaded by ``-p conformance.pytest_plugin`` ([Note: opt-in plugins]), so it applies to
``pytest -n N`` and to ``fsdp-conformance run -n N`` alike.

[Note: timing phase]
A test that measures wall time (``@pytest.mark.timing``; conformance cases
declare ``@case(..., timing=True)``) means what it says only on an otherwise
idle machine. Under ``-n N`` the controller schedules with
:class:`TimingLastScheduling`, xdist's own load scheduling with one change:
timing tests are held back. When every other test has been handed out, one
worker is chosen for the timing phase and the others are shut down; once
they have *finished* (their last test done, their rank pools stopped: xdist's
``workerfinished``), the held tests go to that worker, one after another, with
no other test running anywhere. Without ``-n`` nothing changes: the session
runs serially in collection order.

The controller does not collect, so it learns which collection indices are
timing tests from the workers: each worker writes them (after ``-k``/``-m``
deselection, so indices match the collection it reports) to a file in a
directory the controller passes through xdist's ``workerinput``, before it
sends its collection. That needs the workers on this machine, which is what
``-n`` starts.

[Note: collection order]
Every session records each item's collection index (:func:`collection_index`;
xdist checks that every worker collects the same items in the same order).
Under ``-n`` a worker attaches it to each report it sends (the attribute
:data:`INDEX_ATTR`, serialized with the report), so the controller can put
what arrives from several workers back in the order a serial run produces:
the conformance results ([Note: result transport] in
:mod:`conformance.runner.transport`) and the JUnit XML's test cases.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

# pytest's JUnit writer has no public API for the order of its test cases; these two
# internals (pytest 7.4 to 9.x) let the controller sort them. conformance/tests/runner/test_parallel.py
# compares the JUnit XML of a serial and a parallel run, so a change in them shows there.
from _pytest.junitxml import mangle_test_address, xml_key
from xdist.scheduler import LoadScheduling
from xdist.workermanage import WorkerController

from harness.plugin.workers import (
    INDEX_ATTR,
    ORDER_KEY,
    TIMING_MARK,
    auto_workers,
    collection_index,
    is_timing,
    is_worker,
    report_index,
)
from harness.ranks.cpu_budget import available_cores

__all__ = ["TimingLastScheduling"]

_ARRIVED_KEY = pytest.StashKey[dict[tuple[str, str], int]]()  # controller: JUnit (classname, name) -> index
_DIR_KEY = pytest.StashKey[str]()
_WORKERINPUT_DIR = "fsdp_timing_dir"


# -- every session ---------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{TIMING_MARK}: measures wall time; under -n it runs after every other test, alone on one worker",
    )
    dist = config.getoption("dist", "no")
    if dist not in ("no", "load") and not is_worker(config):
        raise pytest.UsageError(
            f"--dist {dist}: this suite schedules with --dist load (the -n default), which runs "
            f"@pytest.mark.{TIMING_MARK} tests alone after the others; other modes cannot"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Record collection indices; on an xdist worker, report the timing ones before xdist sends the collection."""
    for index, item in enumerate(session.items):
        item.stash[ORDER_KEY] = index
    workerinput: dict[str, Any] | None = getattr(session.config, "workerinput", None)
    if workerinput is None or _WORKERINPUT_DIR not in workerinput:
        return
    timing = [index for index, item in enumerate(session.items) if is_timing(item)]
    path = _timing_file(workerinput[_WORKERINPUT_DIR], str(workerinput["workerid"]))
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(timing))
    partial.replace(path)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if is_worker(item.config):
        setattr(report, INDEX_ATTR, collection_index(item))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller: remember where each arriving test sits in the collection."""
    index = report_index(report)
    node = getattr(report, "node", None)  # the sending worker; xdist sets it on the controller
    if index is None or node is None:
        return
    config: pytest.Config = node.config
    xml = config.stash.get(xml_key, None)
    if xml is not None:
        config.stash.setdefault(_ARRIVED_KEY, {})[_junit_key(report.nodeid, xml.prefix)] = index


def _junit_key(nodeid: str, prefix: str | None) -> tuple[str, str]:
    """The ``(classname, name)`` pytest's JUnit XML gives a test."""
    names = mangle_test_address(nodeid)
    return ".".join([prefix, *names[:-1]] if prefix else names[:-1]), names[-1]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """On the controller, before JUnit XML is written: its test cases in collection order."""
    order = session.config.stash.get(_ARRIVED_KEY, {})
    xml = session.config.stash.get(xml_key, None)
    if not order or xml is None:
        return
    last = len(order)

    def position(reporter: Any) -> int:
        element = reporter.to_xml()  # a finished test case's element, as it will be written
        return order.get((element.get("classname", ""), element.get("name", "")), last)

    xml.node_reporters_ordered.sort(key=position)


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_DIR_KEY, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


# -- the xdist controller --------------------------------------------------------------


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: WorkerController) -> None:
    """Tell each worker where to report its timing tests."""
    config = node.config
    if _DIR_KEY not in config.stash:
        config.stash[_DIR_KEY] = tempfile.mkdtemp(prefix="fsdp-timing-")
    node.workerinput[_WORKERINPUT_DIR] = config.stash[_DIR_KEY]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: :func:`auto_workers` of this machine's cores (``PYTEST_XDIST_AUTO_NUM_WORKERS`` wins)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own implementation reads and validates it
    return auto_workers(available_cores())


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> TimingLastScheduling:
    directory = config.stash[_DIR_KEY]
    return TimingLastScheduling(config, log, lambda node: _read_timing(directory, node))


def _timing_file(directory: str, worker_id: str) -> Path:
    return Path(directory) / f"{worker_id}.json"


def _read_timing(directory: str, node: WorkerController) -> list[int]:
    worker_id = str(node.gateway.id)
    path = _timing_file(directory, worker_id)
    try:
        return [int(i) for i in json.loads(path.read_text())]
    except FileNotFoundError:
        raise RuntimeError(
            f"xdist worker {worker_id} did not report its timing tests in {path}: "
            "workers must run on this machine (-n N), not through --tx to another host"
        ) from None


class TimingLastScheduling(LoadScheduling):
    """xdist's load scheduling, with timing tests held for a final phase on one worker alone.

    ``timing_of(node)`` gives the collection indices of timing tests in ``node``'s
    collection ([Note: timing phase]).
    """

    collection: list[str] | None
    maxschedchunk: int | None

    def __init__(self, config: pytest.Config, log: Any, timing_of: Callable[[WorkerController], Sequence[int]]):
        super().__init__(config, log)
        self._timing_of = timing_of
        self.timing: frozenset[int] = frozenset()
        self.held: list[int] = []
        self.timing_node: WorkerController | None = None

    @property
    def tests_finished(self) -> bool:
        return not self.held and bool(super().tests_finished)

    @property
    def has_pending(self) -> bool:
        return bool(self.held) or bool(super().has_pending)

    def schedule(self) -> None:
        """First call: split the collection into the load phase and the held timing tests."""
        assert self.collection_is_completed
        if self.collection is None:
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            node, collection = next(iter(self.node2collection.items()))
            self.collection = collection
            self.timing = frozenset(self._timing_of(node))
            self.held = sorted(self.timing)
            self.pending[:] = [i for i in range(len(collection)) if i not in self.timing]
            if self.maxschedchunk is None:
                self.maxschedchunk = len(collection)
        for node in self.nodes:
            self.check_schedule(node)

    def check_schedule(self, node: WorkerController, duration: float = 0) -> None:
        if node.shutting_down:
            return
        if self.pending:
            super().check_schedule(node, duration=duration)  # never shuts a node down while tests are pending
        elif self.held:
            self._timing_phase()
        else:
            node.shutdown()

    def _timing_phase(self) -> None:
        """Shut every worker but one down; once they are gone, hand that one the timing tests."""
        if self.timing_node not in self.node2pending:
            live = [n for n in self.nodes if not n.shutting_down]
            if not live:
                return  # every worker is going down (a failure stop, or a crash being replaced)
            self.timing_node = max(live, key=lambda n: len(self.node2pending[n]))
        for node in self.nodes:
            if node is not self.timing_node:
                node.shutdown()
        if len(self.node2pending) == 1 and self.timing_node is not None:
            self._send(self.timing_node, self.held)
            self.held = []
            self.timing_node.shutdown()

    def _send(self, node: WorkerController, indices: list[int]) -> None:
        self.node2pending[node].extend(indices)
        node.send_runtest_some(indices)

    def remove_node(self, node: WorkerController) -> str | None:
        """A worker left: when it crashed, its unfinished tests go back to the phase they belong to."""
        pending = self.node2pending.pop(node)
        if node is self.timing_node:
            self.timing_node = None
        crashitem = None
        if pending:
            assert self.collection is not None
            crashitem = self.collection[pending.pop(0)]
            self.pending.extend(i for i in pending if i not in self.timing)
            self.held = sorted([*self.held, *(i for i in pending if i in self.timing)])
        for other in self.nodes:
            self.check_schedule(other)
        return crashitem
