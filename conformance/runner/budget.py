"""The run's time budget (``--max-time S``): rows not started when it is spent are reported ``not run``.

[Note: run budget]
A hanging implementation costs each row its case timeout (``--case-timeout``,
else the case's own, shown by ``fsdp-conformance list``); over a matrix of
hundreds of rows that is hours. With ``--max-time S`` the run's deadline is
fixed when the session starts (on the xdist controller, and handed to every
worker, so all of them stop at the same moment); a row that would start
after it is not started and is reported ``not run`` with the reason, and
the run exits 1 (it cannot claim conformance). Rows already running when
the budget is spent finish, each within its case timeout, so a run ends by
``max time + case timeout`` (plus the harness's pool start margin).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from conformance.contract.results import Result

__all__ = ["NotRun", "not_run_reason"]

_DEADLINE_KEY = pytest.StashKey["float | None"]()
_LIMIT_KEY = pytest.StashKey[int]()
_NOT_RUN_KEY = pytest.StashKey[int]()
_WORKERINPUT = "fsdp_conformance_deadline"


class NotRun(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """Raised in a row's setup when the run's budget is spent: the row is reported ``not run``."""


def start(config: pytest.Config, max_time: int | None) -> None:
    """Fix the deadline (a worker takes its controller's); called once the settings are resolved."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[_DEADLINE_KEY] = workerinput.get(_WORKERINPUT)
    else:
        config.stash[_DEADLINE_KEY] = None if max_time is None else time.time() + max_time
    if max_time is not None:
        config.stash[_LIMIT_KEY] = max_time


def not_run_reason(config: pytest.Config) -> str | None:
    """Why a row must not start now, ``None`` while the budget lasts (or there is none)."""
    deadline = config.stash.get(_DEADLINE_KEY, None)
    if deadline is None or time.time() < deadline:
        return None
    return f"not run: the run's --max-time budget of {config.stash.get(_LIMIT_KEY, '?')} s was spent"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Every xdist worker stops at the controller's deadline."""
    config: pytest.Config = node.config
    node.workerinput[_WORKERINPUT] = config.stash.get(_DEADLINE_KEY, None)


@pytest.hookimpl
def pytest_conformance_result(config: pytest.Config, result: Result) -> None:
    if result.outcome == "not run":
        config.stash[_NOT_RUN_KEY] = config.stash.get(_NOT_RUN_KEY, 0) + 1


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Rows left unrun make the run fail: it did not check what it was asked to."""
    if session.config.stash.get(_NOT_RUN_KEY, 0) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
