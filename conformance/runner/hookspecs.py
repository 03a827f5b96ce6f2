"""Hooks the conformance plugin calls; other plugins implement them.

Registered by :func:`conformance.runner.plugin.pytest_addhooks` (pytest-xdist's
``newhooks.py`` is the model). The conformance plugin itself implements
:func:`pytest_conformance_result` to build the matrix, so a plugin that moves
results between processes (parallel workers) implements it too and calls the
hook with the results it receives.

The conformance plugin in turn implements the harness's hook
``pytest_ranks_returned`` (:mod:`harness.plugin.hookspecs`) to receive each case's
:class:`~conformance.contract.results.CaseReport`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conformance.contract.results import Result


@pytest.hookspec
def pytest_conformance_result(config: pytest.Config, result: Result) -> None:
    """One matrix cell is decided (called once per case x implementation x rank mode)."""
