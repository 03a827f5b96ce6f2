"""The project's own test sessions: tests marked ``nightly`` run only with ``--nightly``
([Note: nightly tests] in ``conformance/tests/__init__.py``)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--nightly", action="store_true", default=False,
                     help="also run the tests marked nightly (the mutant runs, soak tests): the nightly job's set")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--nightly"):
        return
    left = [item for item in items if item.get_closest_marker("nightly") is not None]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item.get_closest_marker("nightly") is None]


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--nightly"):
        return "nightly: the tests marked nightly run too"
    return "nightly: the tests marked nightly (mutant runs, soak tests) are left out; --nightly runs them"
