"""Which role this pytest process plays under pytest-xdist, and where each test sits in the collection.

Nothing here imports xdist: the conformance plugin and the harness ask these
questions in serial sessions too. The scheduling plugin that uses them to run
timing tests alone is :mod:`harness.plugin.scheduling` ([Note: timing phase],
[Note: collection order] there).
"""

from __future__ import annotations

import pytest

__all__ = ["INDEX_ATTR", "ORDER_KEY", "TIMING_MARK", "MIN_AUTO_WORKERS", "RANKS_PER_CASE", "auto_workers",
           "collection_index", "is_controller", "is_timing", "is_worker", "report_index"]

TIMING_MARK = "timing"
#: Report attribute carrying the item's collection index from a worker ([Note: collection order]).
INDEX_ATTR = "collection_index"
#: Each item's collection index, set by :mod:`harness.plugin.scheduling` when collection finishes.
ORDER_KEY = pytest.StashKey[int]()
#: Rank processes a typical case starts; ``-n auto`` gives each worker this many cores.
RANKS_PER_CASE = 2
#: ``-n auto`` starts at least this many workers on a machine with two cores or more: on 2 cores
#: two workers took 0.79-0.85 of the serial wall time of the main job, three were no faster than
#: two (docs/PERFORMANCE.md, "Suite time").
MIN_AUTO_WORKERS = 2


def is_timing(item: pytest.Item) -> bool:
    """Whether ``item`` measures wall time and must run alone ([Note: timing phase])."""
    return item.get_closest_marker(TIMING_MARK) is not None


def collection_index(item: pytest.Item) -> int:
    """``item``'s position in the session's final collection (identical on every xdist worker)."""
    try:
        return item.stash[ORDER_KEY]
    except KeyError:
        raise LookupError(f"{item.nodeid}: no collection index (collection has not finished)") from None


def report_index(report: pytest.TestReport) -> int | None:
    """The collection index a worker attached to ``report`` (``None`` in a serial session)."""
    value = getattr(report, INDEX_ATTR, None)
    return None if value is None else int(value)


def is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (xdist gives workers ``workerinput``)."""
    return hasattr(config, "workerinput")


def is_controller(config: pytest.Config) -> bool:
    """Whether this process distributes tests to xdist workers (and renders what they report)."""
    return config.pluginmanager.has_plugin("dsession")


def auto_workers(cores: int, ranks_per_case: int = RANKS_PER_CASE) -> int:
    """Workers for ``-n auto``: one per ``ranks_per_case`` cores, at least :data:`MIN_AUTO_WORKERS`
    with two cores or more; 0 (serial) on one core."""
    if cores < 1 or ranks_per_case < 1:
        raise ValueError(f"cores and ranks_per_case must be >= 1, got {cores} and {ranks_per_case}")
    if cores < 2:
        return 0
    return max(cores // ranks_per_case, MIN_AUTO_WORKERS)
