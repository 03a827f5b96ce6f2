"""pytest plugin: the run's side of ``--conformance-expect BASELINE.json`` ([Note: expected outcomes] in
:mod:`conformance.runner.expect`).

The baseline is read when the session is configured (a bad one is a usage error naming its path, before any
row runs); at the end :func:`show`, called by the conformance plugin where it prints the matrix, compares the
rows and prints the differences first; this plugin's last terminal-summary hook then sets the exit status
from the comparison, unless the session already ended otherwise (usage or internal error, interrupted).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from conformance.contract.results import Result
from conformance.runner.document import RunReport, load_baseline
from conformance.runner.expect import Comparison, compare, render_text
from harness.plugin.workers import is_worker

__all__ = ["OPTION", "show"]

OPTION = "--conformance-expect"
_BASELINE_KEY = pytest.StashKey[tuple[str, RunReport]]()
#: The comparison :func:`show` made, and whether every selected row reached the matrix.
_COMPARED_KEY = pytest.StashKey[tuple[Comparison, bool]]()
_SESSION_KEY = pytest.StashKey[pytest.Session]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("fsdp-conformance").addoption(
        OPTION, metavar="BASELINE.json",
        help="compare each cell with this JSON report of an earlier run: exit 0 when nothing changed (its FAILs "
        "are expected), 1 on a new FAIL or error, a changed outcome or reason, or a cell that now passes "
        "(docs/REPORTS.md: Comparing with a baseline)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Read the baseline :data:`OPTION` names, if any, before report paths are claimed."""
    path = config.getoption(OPTION, None)
    if path is not None:
        try:
            config.stash[_BASELINE_KEY] = (str(path), load_baseline(Path(path), OPTION))
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION_KEY] = session


def show(reporter: Any, results: Sequence[Result], selected: int | None, printed: bool) -> Comparison | None:
    """Compare ``results`` with the baseline and, when ``printed``, print the differences; ``None`` when there is
    no baseline, or on an xdist worker (its controller has every row and decides). Every rank of a launched
    job has every row, so each compares and exits alike; rank 0 alone prints."""
    config = reporter.config
    baseline = config.stash.get(_BASELINE_KEY, None)
    if baseline is None or is_worker(config):
        return None
    comparison = compare(baseline[1].rows, results, baseline[0])
    config.stash[_COMPARED_KEY] = (comparison, len(results) == selected)
    if not printed:
        return comparison
    reporter.write_sep("=", "conformance: changes against the baseline")
    reporter.write_line(render_text(comparison), red=comparison.changed, green=not comparison.changed)
    return comparison


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """With a baseline, the comparison decides whether the run failed ([Note: expected outcomes])."""
    compared = config.stash.get(_COMPARED_KEY, None)
    session = config.stash.get(_SESSION_KEY, None)
    if compared is None or session is None:
        return
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        session.exitstatus = _status(compared[0], terminalreporter.stats, compared[1])


def _status(comparison: Comparison, stats: dict[str, list[Any]], complete: bool) -> pytest.ExitCode:
    """Failed on a change, on a run whose rows did not all reach the matrix (``-x``), and on a failed test that
    is no conformance row (a plain pytest test run alongside)."""
    others = [r for key in ("failed", "error") for r in stats.get(key, ())
              if "conformance" not in getattr(r, "keywords", {})]
    failed = comparison.changed or bool(others) or not complete
    return pytest.ExitCode.TESTS_FAILED if failed else pytest.ExitCode.OK
