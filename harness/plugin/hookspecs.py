"""Hooks the harness's pytest plugin calls; other plugins implement them.

Registered by :func:`harness.plugin.pytest_plugin.pytest_addhooks`. A hook's
specification lives with the plugin that calls it, so plugins above the
harness (the conformance suite) implement these without the harness knowing
them.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec
def pytest_ranks_returned(item: pytest.Item, values: list[Any]) -> None:
    """A ``@pytest.mark.ranks`` test's body returned on every rank.

    ``values[r]`` is what rank ``r`` returned (rank order). Called in the
    parent, before the test's report is made; an exception raised here fails
    the test.
    """


@pytest.hookspec(firstresult=True)
def pytest_ranks_placement(item: pytest.Item) -> str | None:
    """The placement a ``ranks`` test's body runs under: ``cpu``, ``cuda`` or ``cuda-shared``.

    Called just before the body runs; the first non-``None`` answer wins.
    Without one, the marker's ``placement`` (default ``cpu``) is used. A plugin
    that plans placements (the conformance suite, from its device setting)
    answers for its own items ([Note: placements] in :mod:`harness.ranks.devices`).
    """


@pytest.hookspec(firstresult=True)
def pytest_ranks_timeout(item: pytest.Item) -> float | None:
    """Seconds a ``ranks`` test's ranks may take before the harness stops them as hung.

    Asked at collection (pytest-timeout guards the parent with it plus the pool's
    start-up margin) and when the body runs; the first non-``None`` answer wins,
    else the marker's ``timeout_s``. A plugin whose settings decide a timeout
    (the conformance suite) answers for its own items.
    """


@pytest.hookspec(firstresult=True)
def pytest_ranks_world_size(item: pytest.Item) -> int | None:
    """How many ranks a ``ranks`` test's body runs on.

    Called just before the body runs; the first non-``None`` answer wins, else the
    marker's ``world_size``. A plugin whose cases run at the size a run asks for (the
    conformance suite's scalable cases, [Note: world sizes]) answers for its own items.
    """
