"""Conformance results and the matrix, JSON and markdown renderings of them."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["OUTCOMES", "CaseReport", "Result", "render_matrix", "render_markdown", "summary_line", "write_json"]

#: Cell texts. Only "pass" counts as conforming; "n/a" and "skip" never do.
OUTCOMES = ("pass", "FAIL", "error", "n/a", "skip")


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

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r} not in {OUTCOMES}")


def _columns(results: Sequence[Result]) -> list[tuple[str, str]]:
    cols: list[tuple[str, str]] = []
    for r in results:
        if (r.impl, r.rank_mode) not in cols:
            cols.append((r.impl, r.rank_mode))
    return cols


def _rows(results: Sequence[Result]) -> list[str]:
    rows: list[str] = []
    for r in results:
        if r.case not in rows:
            rows.append(r.case)
    return sorted(rows)


def _cells(results: Sequence[Result]) -> dict[tuple[str, str, str], Result]:
    return {(r.case, r.impl, r.rank_mode): r for r in results}


def _placements(results: Sequence[Result]) -> dict[str, str]:
    """Each row's placement(s) over its cells; ``-`` when none of its cells could be placed."""
    found: dict[str, list[str]] = {}
    for r in results:
        names = found.setdefault(r.case, [])
        if r.placement and r.placement not in names:
            names.append(r.placement)
    return {case: ",".join(names) or "-" for case, names in found.items()}


def render_matrix(results: Sequence[Result]) -> str:
    """Plain-text matrix: rows = cases, then the row's placement, then one column per impl/rank mode."""
    if not results:
        return "(no conformance results)"
    cols, rows, cells, places = _columns(results), _rows(results), _cells(results), _placements(results)
    headers = ["placement", *(f"{impl}/{mode}" for impl, mode in cols)]
    first = max(len("case"), *(len(row) for row in rows))
    widths = [max(len(h), 5) for h in headers]
    widths[0] = max(widths[0], *(len(p) for p in places.values()))
    lines = ["  ".join(["case".ljust(first), *(h.ljust(w) for h, w in zip(headers, widths, strict=True))])]
    lines.append("  ".join(["-" * first, *("-" * w for w in widths)]))
    for row in rows:
        texts = [places[row], *(cells[(row, i, m)].outcome if (row, i, m) in cells else "" for i, m in cols)]
        lines.append("  ".join([row.ljust(first), *(t.ljust(w) for t, w in zip(texts, widths, strict=True))]))
    return "\n".join(line.rstrip() for line in lines)


def summary_line(results: Iterable[Result]) -> str:
    counts = {outcome: 0 for outcome in OUTCOMES}
    total = 0.0
    for r in results:
        counts[r.outcome] += 1
        total += r.duration_s
    parts = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
    return f"conformance: {parts or 'nothing ran'} in {total:.1f} s of case time"


def render_markdown(results: Sequence[Result], *, title: str = "Conformance matrix") -> str:
    """A markdown table, plus the reason of every non-passing cell."""
    cols, rows, cells, places = _columns(results), _rows(results), _cells(results), _placements(results)
    out = [f"## {title}", "", "| case | placement | " + " | ".join(f"{i} ({m})" for i, m in cols) + " |"]
    out.append("|---|---|" + "---|" * len(cols))
    for row in rows:
        texts = [cells[(row, i, m)].outcome if (row, i, m) in cells else "" for i, m in cols]
        out.append(f"| `{row}` | {places[row]} | " + " | ".join(texts) + " |")
    notes = [r for r in results if r.outcome != "pass" and r.reason]
    if notes:
        out += ["", "### Reasons", ""]
        for r in sorted(notes, key=lambda r: (r.case, r.impl, r.rank_mode)):
            reason = r.reason.strip().splitlines()[0][:300]
            out.append(f"- `{r.case}` on {r.impl} ({r.rank_mode}): **{r.outcome}** — {reason}")
    return "\n".join(out) + "\n"


def write_json(results: Sequence[Result], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
