"""A mutant's verdict, from its run and the unmutated baseline run of the same rows.

In order, the first that holds:

``import-broken``  a process failed while executing the mutated module: torch itself
                   broke, which says nothing about the suite (reported apart).
``not reached``    no process of the run but its controller imported the mutated module:
                   the rows never had it. The controller (the ``conformance run`` process)
                   imports torch's FSDP through the adapter but runs no row; the rows run
                   in rank processes and thread hosts, forked from a forkserver that imports
                   it, or spawned.
``killed``         a cell (row x implementation x rank mode) whose outcome is ``FAIL`` or
                   ``error`` where the baseline's is not, or whose ``FAIL`` no registered
                   finding explains where the baseline's was a known finding's (a row such as
                   a stateful fuzzer's goes past the findings it meets, so under a mutant it
                   can fail for a reason of its own): the killers. A run stopped for
                   time still writes the cells it decided, and a kill among them counts.
``timed out``      the run exceeded its time limit with no such cell.
``killed``         a run that crashed: no report, an exit code other than the
                   baseline's, or cells of the baseline missing.
``survived``       none of these.

A cell changing to ``n/a`` or ``skip`` does not kill (it is no failure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance.selftest.torch_mutants.injection import Markers

__all__ = ["FAILING", "VERDICTS", "RunResult", "Verdict", "classify", "report_cells"]

#: The outcomes that kill a mutant when the baseline's cell has another.
FAILING = frozenset({"FAIL", "error"})
#: Every verdict, in the order the summary lists them.
VERDICTS = ("killed", "survived", "timed out", "not reached", "import-broken")

Cell = tuple[str, str, str]


@dataclass(frozen=True)
class RunResult:
    """One run of the rows: exit code (``None`` when killed for time), report (``None`` when none), markers,
    and the controller's pid (``None``: unknown, every marker counts as a rank's)."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    report: dict[str, Any] | None
    markers: Markers = field(default_factory=lambda: Markers((), (), ()))
    controller: int | None = None

    def imported_beyond_controller(self) -> tuple[dict[str, object], ...]:
        """The import markers of the processes other than the controller."""
        return tuple(entry for entry in self.markers.imported if entry.get("pid") != self.controller)


@dataclass(frozen=True)
class Verdict:
    """A mutant's verdict, the cells that killed it, and a line on why."""

    verdict: str
    killers: tuple[str, ...] = ()
    detail: str = ""


def report_cells(report: dict[str, Any]) -> dict[Cell, str]:
    """A schema-2 JSON report's cells (case, implementation, rank mode) -> outcome, a ``FAIL`` a registered
    finding explains written ``FAIL (known: <write-up>)``."""
    return {(row["case"], row["impl"], row["rank_mode"]): _outcome(row) for row in report.get("rows", [])}


def _outcome(row: dict[str, Any]) -> str:
    finding = row.get("finding")
    return f"{row['outcome']} (known: {finding})" if row["outcome"] == "FAIL" and finding else row["outcome"]


def _killed_by_rows(baseline: dict[Cell, str], run: dict[Cell, str]) -> tuple[str, ...]:
    """The cells failing under the mutant for a reason the baseline's cell did not have: a failure where it
    had none, or one no finding explains where it had a known finding's (a different known finding is none)."""
    def known(outcome: str | None) -> bool:
        return outcome is not None and outcome.startswith("FAIL (known")

    def kills(before: str | None, outcome: str) -> bool:
        if outcome in FAILING:
            return before != outcome
        return known(outcome) and before not in FAILING and not known(before)

    return tuple(f"{case} [{mode}]: {baseline.get((case, impl, mode), 'no cell')} -> {outcome}"
                 for (case, impl, mode), outcome in run.items() if kills(baseline.get((case, impl, mode)), outcome))


def _crash(baseline: RunResult, run: RunResult) -> str:
    """Why ``run`` crashed where the baseline did not, or ``""``."""
    if run.report is None:
        return f"no report (exit {run.returncode})"
    if run.returncode != baseline.returncode:
        return f"exit {run.returncode} (baseline {baseline.returncode})"
    assert baseline.report is not None
    missing = set(report_cells(baseline.report)) - set(report_cells(run.report))
    return f"{len(missing)} cells of the baseline missing" if missing else ""


def classify(baseline: RunResult, run: RunResult) -> Verdict:
    """``run``'s verdict against ``baseline`` (whose report must exist)."""
    if baseline.report is None:
        raise ValueError("the baseline run wrote no report: no verdict can be given")
    if run.markers.import_errors:
        first = run.markers.import_errors[0]
        last_line = str(first.get("detail", "")).strip().splitlines()[-1:] or [""]
        return Verdict("import-broken", detail=f"{first['module']}: {last_line[0]}")
    if not run.imported_beyond_controller():
        return Verdict("not reached", detail="no process but the controller imported the mutated module")
    killers = _killed_by_rows(report_cells(baseline.report), report_cells(run.report or {}))
    if killers:
        return Verdict("killed", killers, f"then stopped after {run.wall_s:.0f} s" if run.timed_out else "")
    if run.timed_out:
        return Verdict("timed out", detail=f"stopped after {run.wall_s:.0f} s")
    crash = _crash(baseline, run)
    if crash:
        return Verdict("killed", detail=f"crash: {crash}")
    return Verdict("survived")
