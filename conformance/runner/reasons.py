"""The one-line reason a matrix cell shows, from pytest's report of the row."""

from __future__ import annotations

import pytest

__all__ = ["failure_reason", "skip_reason"]


def failure_reason(call: pytest.CallInfo[None], report: pytest.TestReport) -> str:
    """First line of the failure; a rank failure's own summary already names the rank."""
    from harness.ranks.errors import RankFailure

    if call.excinfo is None:
        return _first_line(report.longreprtext)
    if isinstance(call.excinfo.value, RankFailure):
        return _first_line(str(call.excinfo.value))
    return _first_line(call.excinfo.exconly())


def _first_line(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line[:400]


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return _first_line(str(longrepr))
