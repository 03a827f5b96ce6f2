"""The matrix and markdown renderings of a run's results (:mod:`conformance.contract.results`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from conformance.contract.results import OUTCOMES, Result

__all__ = ["render_matrix", "render_markdown", "summary_line"]


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

