"""One line per finished cell, ``[ 150/362] pass  area/case[...]  impl/mode  1.23s``, in every mode.

A serial run decides a cell in the item's teardown, while pytest captures
output: the line is written with capturing suspended, so it reaches the
terminal as the case finishes, not at the end. The total is the number of
items this run selected: the session's collection, or (under pytest-xdist,
on the controller) what the workers report they collected.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.contract.results import Result

__all__ = ["line", "write_line"]

_TOTAL_KEY = pytest.StashKey[int]()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_TOTAL_KEY] = len(session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """The controller's total: every worker collects the same items."""
    node.config.stash[_TOTAL_KEY] = len(ids)


def line(config: pytest.Config, count: int, result: Result) -> str:
    """The progress line of the ``count``-th result."""
    total = config.stash.get(_TOTAL_KEY, None)
    width = len(str(total)) if total else 4
    where = f"[{count:{width}d}/{total}]" if total else f"[{count:{width}d}]"
    text = f"{where} {result.outcome:5s} {result.case}  {result.impl}/{result.rank_mode}  {result.duration_s:.2f}s"
    return text + (f"  ({result.reason})" if result.reason else "")


def write_line(config: pytest.Config, text: str) -> None:
    """Write ``text`` to the terminal now, even inside a test's captured phase."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is None:
        reporter.write_line(text)
        return
    with capman.global_and_fixture_disabled():
        reporter.write_line(text)
