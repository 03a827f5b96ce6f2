"""Conformance results from pytest-xdist workers to the controller, in collection order.

Loaded by ``-p conformance.pytest_plugin`` ([Note: opt-in plugins]); it
does nothing in a serial session.

[Note: result transport]
Under ``-n N`` each worker decides its cells (``pytest_conformance_result``
fires there), but the matrix and the reports belong to the controller, which
sees the whole run. A worker keeps the results of the item being torn down
and attaches them to that item's teardown report as the attribute
:data:`REPORT_ATTR` (xdist serializes a report's attributes with it). The
controller reads them in ``pytest_runtest_logreport`` and calls
``pytest_conformance_result`` with them, so the conformance plugin builds the
matrix and prints progress lines there, as results arrive. Before anything is
rendered the controller sorts the results by the collection index each report
carries ([Note: collection order] in :mod:`harness.plugin.scheduling`): the order
of a serial run.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from conformance.contract.results import Result
from conformance.runner.plugin import RESULTS_KEY, SELECTED_KEY
from harness.plugin.workers import is_controller, is_worker, report_index

__all__ = ["REPORT_ATTR", "SELECTED_OUTPUT"]

#: Teardown-report attribute: the item's results, each a :class:`Result` as a dict.
REPORT_ATTR = "conformance_results"
#: Worker output key: the cells the worker's collection selected (every worker collects the same items), so
#: the controller, which collects nothing itself, can tell a complete run from one that ended early.
SELECTED_OUTPUT = "conformance_selected"
_OUTBOX_KEY = pytest.StashKey[list[Result]]()  # worker: results of the item being torn down
_ARRIVED_KEY = pytest.StashKey[list[tuple[int, Result]]]()  # controller: (collection index, result)


@pytest.hookimpl
def pytest_conformance_result(config: pytest.Config, result: Result) -> None:
    """On a worker, keep the result for the item's teardown report."""
    if is_worker(config):
        config.stash.setdefault(_OUTBOX_KEY, []).append(result)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    outbox = item.config.stash.get(_OUTBOX_KEY, [])
    if report.when == "teardown" and outbox:
        setattr(report, REPORT_ATTR, [asdict(r) for r in outbox])
        outbox.clear()
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller: a worker's results go to the matrix, remembering their place."""
    payload = getattr(report, REPORT_ATTR, None)
    node = getattr(report, "node", None)  # the sending worker; xdist sets it on the controller
    index = report_index(report)
    if payload is None or node is None or index is None:
        return
    config: pytest.Config = node.config
    for fields in payload:
        result = Result(**fields)
        config.stash.setdefault(_ARRIVED_KEY, []).append((index, result))
        config.hook.pytest_conformance_result(config=config, result=result)


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(config: pytest.Config) -> None:
    """Before the conformance plugin renders: the results in collection order (stable within an item)."""
    arrived = config.stash.get(_ARRIVED_KEY, [])
    if arrived and is_controller(config):
        config.stash[RESULTS_KEY][:] = [r for _, r in sorted(arrived, key=lambda pair: pair[0])]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a worker: hand the controller the number of cells its collection selected."""
    selected = session.config.stash.get(SELECTED_KEY, None)
    if is_worker(session.config) and selected is not None:
        session.config.workeroutput[SELECTED_OUTPUT] = selected  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the controller: a finished worker's count of selected cells (a worker that died sends none)."""
    selected = getattr(node, "workeroutput", {}).get(SELECTED_OUTPUT)
    if selected is not None:
        config: pytest.Config = node.config
        config.stash[SELECTED_KEY] = max(selected, config.stash.get(SELECTED_KEY, 0))
