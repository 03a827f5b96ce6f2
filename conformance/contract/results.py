"""What a conformance run decides: one :class:`Result` per cell, and what a case body may report.

Part of the contract: a case body returns ``None`` or a :class:`CaseReport`;
reports and plugins receive :class:`Result` values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["OUTCOMES", "CaseReport", "Result"]

#: Cell texts. Only "pass" counts as conforming; "documented" (the row fails as the implementation's own
#: documentation says it does: a registered finding of kind ``documented`` explains the failure, see
#: :mod:`conformance.runner.findings`), "n/a", "skip" and "not run" (the run's time budget was spent before
#: the row started) never do. Only "FAIL" and "error" fail a run.
OUTCOMES = ("pass", "FAIL", "documented", "error", "n/a", "skip", "not run")


@dataclass(frozen=True)
class CaseReport:
    """What a case body may return (rank 0's is reported): a note and numbers for the matrix.

    ``reason`` becomes the row's reason when the case passes (e.g. the measured
    times of a timing case); ``metrics`` go to the JSON report. A case that has
    nothing to say returns ``None``.
    """

    reason: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str):
            raise TypeError(f"CaseReport.reason must be a str, got {type(self.reason).__name__}")
        for name, value in self.metrics.items():
            if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"CaseReport.metrics[{name!r}] = {value!r}: expected a str name and a number")
            if not math.isfinite(value):
                raise ValueError(f"CaseReport.metrics[{name!r}] = {value!r}: expected a finite number")


@dataclass(frozen=True)
class Result:
    """One case x implementation x rank mode."""

    case: str  # "area/name[params]"
    impl: str
    rank_mode: str
    world_size: int
    outcome: str
    reason: str
    duration_s: float
    #: Numbers a case reports (e.g. overlap efficiency); empty for most cases.
    metrics: dict[str, float] = field(default_factory=dict)
    #: Where the ranks computed: ``cpu``, ``cuda`` or ``cuda-shared``; ``""`` when the row could not be placed.
    placement: str = ""
    #: The write-up of the known finding that explains this FAIL or documented cell (``docs/findings/...`` or a
    #: URL); ``""`` if none.
    finding: str = ""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r} not in {OUTCOMES}")
