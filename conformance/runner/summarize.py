"""Summarise a ``--json`` report as markdown: outcome counts per area and implementation.

Any schema version (docs/REPORTS.md) is read, through :func:`conformance.runner.document.load_report`.

``python -m conformance.runner.summarize reports/all.json`` prints the table used at
the top of ``docs/CONFORMANCE.md`` (with a last row ``all`` that totals each
implementation and gives its n/a share of its rows), then every FAIL and error with its reason, then every
documented cell with its citation.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from conformance.contract.results import OUTCOMES, Result
from conformance.runner.document import load_report

__all__ = ["main", "summarize"]

_MODE = re.compile(r" \(world_size=\d+, mode=\w+\)")


def summarize(results: list[Result]) -> str:
    impls = sorted({r.impl for r in results})
    areas = sorted({r.case.split("/", 1)[0] for r in results})
    by_area: dict[tuple[str, str], Counter[str]] = {}
    for r in results:
        by_area.setdefault((r.case.split("/", 1)[0], r.impl), Counter())[r.outcome] += 1
    lines = ["| area | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for area in areas:
        lines.append(f"| {area} | " + " | ".join(_cell(by_area.get((area, impl), Counter())) for impl in impls) + " |")
    totals = {impl: sum((c for (_, i), c in by_area.items() if i == impl), Counter()) for impl in impls}
    lines.append("| **all** | " + " | ".join(_cell(totals[impl], share=True) for impl in impls) + " |")
    for outcomes, title in ((("FAIL", "error"), "Failures"), (("documented",), "Documented choices")):
        cells = sorted({(r.case.split("[")[0], r.impl, _MODE.sub("", r.reason)[:220]) for r in results
                        if r.outcome in outcomes})
        if cells:
            lines += ["", f"{title} (case, implementation, first line of the reason; both rank modes merged):", ""]
            lines += [f"- `{case}` on {impl}: {reason}" for case, impl, reason in cells]
    return "\n".join(lines) + "\n"


def _cell(counts: Counter[str], *, share: bool = False) -> str:
    """``N pass, M FAIL, ...`` in outcome order (``-`` for none); with ``share``, the n/a share of the rows."""
    text = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o]) or "-"
    rows = sum(counts.values())
    return text + (f" ({100 * counts['n/a'] / rows:.1f} % n/a)" if share and rows else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.runner.summarize",
        description="Outcome counts per area and implementation of a --json report, then every FAIL.",
    )
    parser.add_argument("report", type=Path, help="a report written by `fsdp-conformance run --json`")
    args = parser.parse_args(argv)
    try:
        report = load_report(args.report)
    except ValueError as exc:
        parser.error(str(exc))
    if not report.complete:
        print(f"(incomplete run: interrupted by {report.header.get('interrupted_by')})\n")
    print(summarize(report.rows))


if __name__ == "__main__":
    main()
