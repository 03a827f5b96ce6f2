"""A run compared with an earlier one: ``--conformance-expect BASELINE.json`` (``fsdp-conformance run --expect``).

[Note: expected outcomes]
The baseline is the suite's own JSON report of an earlier run, read by
:func:`conformance.runner.document.load_baseline` (there is no second format: an
implementation that wants to ship its expected outcomes ships such a report).
Cells (row id x implementation x rank mode) are compared one by one:

* same outcome and, unless both pass, the same reason after :func:`normalise`:
  as expected (a known FAIL included);
* a FAIL or error the baseline does not have for the cell (``new FAIL``,
  ``new error``), a cell whose baseline was FAIL or error that now passes
  (``now passes``: fixed, upstream or here; the baseline wants updating), any
  other change of outcome (``changed outcome``) and the same non-pass outcome
  with another reason (``changed reason``): a change, and the run fails;
* cells of the baseline the run does not have (``missing``: a narrower
  selection, a row removed) and cells it has that the baseline does not
  (``new cell``) are listed; they fail the run only as a ``new FAIL`` or
  ``new error``.

The plugin decides the exit status from :attr:`Comparison.changed` alone (a
run with no change exits 0 with its known FAILs); every report shows the
comparison before the matrix.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from conformance.contract.results import Result

__all__ = ["CHANGES", "LISTED", "Change", "Comparison", "compare", "normalise", "render_text",
           "to_document"]

Cell = tuple[str, str, str]

#: Kinds of difference that fail the run, most prominent first.
CHANGES = ("now passes", "new FAIL", "new error", "changed outcome", "changed reason")
#: Kinds of difference that are listed only.
LISTED = ("missing", "new cell")

_BAD = ("FAIL", "error")

#: What varies from run to run inside a reason, and what it is replaced by (the only normalisation).
_VOLATILE = (
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x?"),  # object and memory addresses
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}:\d+\b"), "HOST:PORT"),  # rendezvous addresses
    (re.compile(r"\bpid[ =]\d+\b"), "pid ?"),  # process ids
    (re.compile(r"\b\d+(?:\.\d+)?(?:e-?\d+)? ?(?:s|ms|us|µs|seconds?)\b"), "? s"),  # timings
    (re.compile(re.escape(tempfile.gettempdir()) + r"/[^\s'\":,)]+"), "TMP"),  # temporary paths
)


def normalise(reason: str) -> str:
    """``reason`` with its run-specific values replaced: addresses (``0x...``), ``host:port``, ``pid N``,
    timings (a number with ``s``, ``ms``, ``us``, ``seconds``) and paths under the temporary directory."""
    text = reason.strip()
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


@dataclass(frozen=True)
class Change:
    """One cell that differs from the baseline: its kind (:data:`CHANGES`, :data:`LISTED`) and both sides."""

    kind: str
    cell: Cell
    expected: Result | None
    actual: Result | None

    def describe(self) -> str:
        """One line: the kind, the cell, and what it was and is."""
        case, impl, mode = self.cell
        was = _side(self.expected)
        now = _side(self.actual)
        return f"{self.kind}: {case} on {impl}/{mode}: {was} -> {now}"


def _side(result: Result | None) -> str:
    if result is None:
        return "(no cell)"
    first = result.reason.strip().splitlines()[0] if result.reason.strip() else ""
    return f"{result.outcome} ({first})" if first and result.outcome != "pass" else result.outcome


@dataclass(frozen=True)
class Comparison:
    """The run against its baseline."""

    baseline: str
    changes: tuple[Change, ...]
    #: Cells whose outcome (and reason) match, and how many of them are FAIL or error.
    as_expected: int
    expected_failures: int
    #: The cells that matched the baseline, so reports can tell an expected FAIL from an unexpected one.
    matched: frozenset[Cell]

    @property
    def changed(self) -> bool:
        """Whether any cell changed in a way that fails the run."""
        return any(change.kind in CHANGES for change in self.changes)

    def of_kind(self, *kinds: str) -> list[Change]:
        return [change for change in self.changes if change.kind in kinds]

    def change_of(self, cell: Cell) -> Change | None:
        return next((change for change in self.changes if change.cell == cell), None)

    def counts(self) -> dict[str, int]:
        """Cells per kind of difference (every kind, zeros included), and those as expected."""
        found = {kind: len(self.of_kind(kind)) for kind in (*CHANGES, *LISTED)}
        return {"as expected": self.as_expected, "expected FAIL or error": self.expected_failures, **found}


def _kind(expected: Result, actual: Result) -> str | None:
    """The kind of difference between the two sides of a cell, ``None`` when there is none."""
    if expected.outcome == actual.outcome:
        if actual.outcome == "pass" or normalise(expected.reason) == normalise(actual.reason):
            return None
        return "changed reason"
    if actual.outcome in _BAD:
        return f"new {actual.outcome}"
    if expected.outcome in _BAD and actual.outcome == "pass":
        return "now passes"
    return "changed outcome"


def compare(baseline: Sequence[Result], results: Sequence[Result], source: str) -> Comparison:
    """``results`` cell by cell against the rows of the ``baseline`` report ([Note: expected outcomes])."""
    before = {(r.case, r.impl, r.rank_mode): r for r in baseline}
    changes: list[Change] = []
    matched: set[Cell] = set()
    for result in results:
        cell = (result.case, result.impl, result.rank_mode)
        expected = before.get(cell)
        if expected is None:
            kind: str | None = f"new {result.outcome}" if result.outcome in _BAD else "new cell"
        else:
            kind = _kind(expected, result)
        if kind is None:
            matched.add(cell)
        else:
            changes.append(Change(kind, cell, expected, result))
    ran = {(r.case, r.impl, r.rank_mode) for r in results}
    changes += [Change("missing", cell, r, None) for cell, r in before.items() if cell not in ran]
    order = {kind: i for i, kind in enumerate((*CHANGES, *LISTED))}
    changes.sort(key=lambda change: (order[change.kind], change.cell))
    failing = sum(1 for r in results if (r.case, r.impl, r.rank_mode) in matched and r.outcome in _BAD)
    return Comparison(source, tuple(changes), len(matched), failing, frozenset(matched))


def _row(result: Result | None) -> dict[str, str] | None:
    return None if result is None else {"outcome": result.outcome, "reason": result.reason}


def to_document(comparison: Comparison) -> dict[str, object]:
    """The comparison as the JSON report's ``expectation`` field (docs/REPORTS.md)."""
    return {"baseline": comparison.baseline, "changed": comparison.changed, "counts": comparison.counts(),
            "changes": [{"kind": c.kind, "case": c.cell[0], "impl": c.cell[1], "rank_mode": c.cell[2],
                         "expected": _row(c.expected), "actual": _row(c.actual)} for c in comparison.changes]}


def render_text(comparison: Comparison, limit: int = 20) -> str:
    """The comparison as the terminal shows it: a verdict, then every change, then the listed cells."""
    verdict = "CHANGED" if comparison.changed else "as expected"
    lines = [f"against {comparison.baseline}: {verdict}; {comparison.as_expected} cells as expected "
             f"({comparison.expected_failures} of them known FAIL or error)"]
    for kind in (*CHANGES, *LISTED):
        found = comparison.of_kind(kind)
        if not found:
            continue
        title = kind.upper() if kind == "now passes" else kind
        lines.append(f"{title} ({len(found)}):")
        lines += [f"  {change.describe()}" for change in found[:limit]]
        if len(found) > limit:
            lines.append(f"  ... {len(found) - limit} more in the JSON report's 'expectation'")
    if comparison.of_kind("now passes"):
        lines.append("cells that now pass were FAIL or error in the baseline: if the fix is meant, make this run's "
                     "JSON report the new baseline")
    return "\n".join(lines)
