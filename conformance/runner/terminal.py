"""The matrix as the terminal shows it: no line wider than the terminal, and why each cell is not a pass.

The wide rendering (:func:`conformance.runner.report.render_matrix`, one column
per implementation/rank mode headed by its name) is used when it fits, and
when the output is no terminal (a CI log; unless ``COLUMNS`` is set). When it
does not, columns are numbered with a legend, the cells come first and the row
id last, continued on the next lines (indented under itself) when it is longer
than what is left. Below the matrix, the reasons of the cells that did not
pass, grouped by outcome and reason with the number of cells, each cut to the
width; the JSON and markdown reports carry every reason in full.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Sequence

from conformance.contract.results import Result
from conformance.runner.report import render_matrix

__all__ = ["MAX_REASON_LINES", "render_terminal", "terminal_width"]

#: Reason lines shown below the matrix at most; the rest are counted.
MAX_REASON_LINES = 30
_MIN_WIDTH = 40


def terminal_width() -> int | None:
    """``COLUMNS`` when set, else the width of the terminal stdout is; ``None`` (no limit) for a pipe or file."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return max(int(columns), _MIN_WIDTH)
    try:
        return max(os.get_terminal_size(sys.__stdout__.fileno()).columns, _MIN_WIDTH)  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):
        return None


def render_terminal(results: Sequence[Result], width: int | None) -> str:
    """The matrix and the reasons, every line at most ``width`` characters (``None``: no limit)."""
    if not results:
        return "(no conformance results)"
    wide = render_matrix(results)
    if width is None:
        return wide + _join(_reasons(results, None))
    table = wide if max(len(ln) for ln in wide.splitlines()) <= width else _narrow(results, width)
    return table + _join(_reasons(results, width))


def _join(reasons: str) -> str:
    return "\n\n" + reasons if reasons else ""


def _cut(text: str, width: int | None) -> str:
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in pieces of at most ``width``, broken after a ``,`` or ``/`` or before a ``[`` where one is."""
    pieces: list[str] = []
    while len(text) > width:
        cut = max(text.rfind(",", 0, width) + 1, text.rfind("/", 0, width) + 1, text.rfind("[", 0, width))
        cut = cut if cut > 0 else width
        pieces.append(text[:cut])
        text = text[cut:]
    return [*pieces, text]


def _narrow(results: Sequence[Result], width: int) -> str:
    columns = list(dict.fromkeys((r.impl, r.rank_mode) for r in results))
    cells = {(r.case, r.impl, r.rank_mode): r.outcome for r in results}
    places: dict[str, list[str]] = {}
    for r in results:
        found = places.setdefault(r.case, [])
        if r.placement and r.placement not in found:
            found.append(r.placement)
    cell_width = max(len(str(len(columns))), *(len(r.outcome) for r in results))
    place_width = max(len("placement"), *(len(",".join(p) or "-") for p in places.values()))
    lead = (cell_width + 1) * len(columns) + place_width + 1
    legend = [_cut(f"  {i + 1}: {impl}/{mode}", width) for i, (impl, mode) in enumerate(columns)]
    header = " ".join([*(str(i + 1).ljust(cell_width) for i in range(len(columns))), "placement".ljust(place_width),
                       "case"])
    lines = ["columns:", *legend, _cut(header, width), _cut("-" * width, width)]
    room = max(width - lead, 10)
    for case in sorted(places):
        texts = [cells.get((case, impl, mode), "").ljust(cell_width) for impl, mode in columns]
        first, *more = _wrap(case, room)
        lines.append(" ".join([*texts, (",".join(places[case]) or "-").ljust(place_width), first]).rstrip())
        lines += [" " * lead + piece for piece in more]
    return "\n".join(lines)


def _reasons(results: Sequence[Result], width: int | None) -> str:
    groups = Counter((r.outcome, r.reason.strip().splitlines()[0] if r.reason.strip() else "(no reason given)")
                     for r in results if r.outcome != "pass")
    if not groups:
        return ""
    order = {"FAIL": 0, "error": 1, "documented": 2, "not run": 3, "skip": 4, "n/a": 5}
    ranked = sorted(groups.items(), key=lambda item: (order.get(item[0][0], 9), -item[1], item[0][1]))
    lines = ["why cells did not pass (cells: reason):"]
    for (outcome, reason), count in ranked[:MAX_REASON_LINES]:
        lines.append(_cut(f"  {outcome} ({count}): {reason}", width))
    if len(ranked) > MAX_REASON_LINES:
        lines.append(f"  ... {len(ranked) - MAX_REASON_LINES} more reasons in the JSON and markdown reports")
    return "\n".join(lines)
