"""Summarise a ``--json`` report as markdown: outcome counts per area and implementation.

Any schema version (docs/REPORTS.md) is read, through :func:`conformance.runner.document.load_report`.

``python -m conformance.runner.summarize reports/all.json`` prints the table used at
the top of ``docs/CONFORMANCE.md``, then every FAIL with its reason.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from conformance.contract.results import OUTCOMES, Result
from conformance.runner.document import load_report

__all__ = ["summarize"]

_MODE = re.compile(r" \(world_size=\d+, mode=\w+\)")


def summarize(results: list[Result]) -> str:
    impls = sorted({r.impl for r in results})
    areas = sorted({r.case.split("/", 1)[0] for r in results})
    counts = Counter((r.case.split("/", 1)[0], r.impl, r.outcome) for r in results)
    lines = ["| area | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for area in areas:
        cells = []
        for impl in impls:
            parts = [f"{counts[(area, impl, o)]} {o}" for o in OUTCOMES if counts[(area, impl, o)]]
            cells.append(", ".join(parts) or "-")
        lines.append(f"| {area} | " + " | ".join(cells) + " |")
    fails = sorted({(r.case.split("[")[0], r.impl, _MODE.sub("", r.reason)[:220]) for r in results
                    if r.outcome in ("FAIL", "error")})
    if fails:
        lines += ["", "Failures (case, implementation, first line of the reason; both rank modes merged):", ""]
        lines += [f"- `{case}` on {impl}: {reason}" for case, impl, reason in fails]
    return "\n".join(lines) + "\n"


def main() -> None:
    report = load_report(Path(sys.argv[1]))
    if not report.complete:
        print(f"(incomplete run: interrupted by {report.header.get('interrupted_by')})\n")
    print(summarize(report.rows))


if __name__ == "__main__":
    main()
