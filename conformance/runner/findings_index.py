"""The results page's generated index of known findings, and its outcome counts per implementation and rank mode.

[Note: generated findings index]
The ``findings`` block of ``docs/CONFORMANCE.md`` lists every finding this suite
registers (:data:`conformance.runner.findings.BUILTIN_FILE`), one item per
write-up, in the order the file first names each: the write-up's title line (its
first line, without the ``#``) as its one-line summary, whether it explains a
``FAIL`` (a bug) or a ``documented`` cell, the implementation and the component
at fault where that is not the implementation, the row patterns it is
registered for, and how many cells of the published report name it as their
finding. A write-up the report's rows name that the file does not (a finding a
package or ``FSDP_CONFORMANCE_FINDINGS`` registered for that run) is listed
after them, and the block ends with the FAIL cells no finding explains. The
index is rendered, not typed: a finding added to the file appears on the page
once it is regenerated, and ``test_results_doc`` fails until it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conformance.contract.results import OUTCOMES, Result
from conformance.runner.findings import Finding

__all__ = ["render_findings", "render_modes"]

_KINDS = {"bug": "FAIL", "documented": "documented"}


@dataclass
class _Entry:
    """What the registrations naming one write-up say together."""

    doc: str
    kinds: list[str] = field(default_factory=list)
    impls: list[str] = field(default_factory=list)
    components: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)

    def add(self, finding: Finding) -> None:
        for values, value in ((self.kinds, _KINDS[finding.kind]), (self.impls, finding.impl),
                              (self.components, finding.component), (self.rows, finding.rows)):
            if value and value not in values:
                values.append(value)


def _entries(findings: Sequence[Finding], rows: Sequence[Result]) -> list[_Entry]:
    """One entry per write-up: the registered ones in the file's order, then those only the report's rows name."""
    entries: dict[str, _Entry] = {}
    for finding in findings:
        entries.setdefault(finding.doc, _Entry(finding.doc)).add(finding)
    for row in rows:
        if row.finding and row.finding not in entries:
            entries[row.finding] = _Entry(row.finding, kinds=[row.outcome], impls=[row.impl])
        elif row.finding in entries and row.impl not in entries[row.finding].impls:
            entries[row.finding].impls.append(row.impl)
    return list(entries.values())


def _title(doc: str, root: Path) -> str:
    """The write-up's first line without its ``#`` markers, or its path where it is not a file under ``root``."""
    path = root / doc
    if "://" in doc or not path.is_file():
        return doc
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[0].lstrip("#").strip() if lines and lines[0].strip() else doc


def _link(doc: str) -> str:
    """``doc`` as a link from a page in ``docs/``."""
    return doc.removeprefix("docs/")


def _item(entry: _Entry, cells: Counter[str], root: Path) -> str:
    at = f" in {', '.join(entry.components)}" if entry.components else ""
    explained = ", ".join(f"{cells[o]} {o}" for o in OUTCOMES if cells[o]) or "none"
    patterns = ", ".join(f"`{pattern}`" for pattern in entry.rows) or "-"
    return (f"- [{_title(entry.doc, root)}]({_link(entry.doc)}): {'/'.join(entry.kinds)}; "
            f"{', '.join(entry.impls)}{at}; cells of this run: {explained}; registered for {patterns}")


def render_findings(findings: Sequence[Finding], rows: Sequence[Result], root: Path) -> str:
    """The ``findings`` block: every write-up of ``findings`` and of ``rows``, then the FAILs none explains."""
    by_doc: dict[str, Counter[str]] = {}
    for row in rows:
        if row.finding:
            by_doc.setdefault(row.finding, Counter())[row.outcome] += 1
    lines = [_item(entry, by_doc.get(entry.doc, Counter()), root) for entry in _entries(findings, rows)]
    unexplained = Counter(row.impl for row in rows if row.outcome in ("FAIL", "error") and not row.finding)
    impls = list(dict.fromkeys(row.impl for row in rows))
    detail = ", ".join(f"{impl} {unexplained[impl]}" for impl in impls if unexplained[impl])
    lines += ["", f"FAIL and error cells no finding explains: {sum(unexplained.values())}"
                  + (f" ({detail})." if detail else ".")]
    return "\n".join(lines) + "\n"


def render_modes(rows: Sequence[Result], modes: Sequence[str]) -> str:
    """The ``modes`` block: outcome counts per implementation (in the rows' order) and rank mode, with the FAIL
    cells that name no finding."""
    counts: dict[tuple[str, str], Counter[str]] = {}
    for row in rows:
        cell = counts.setdefault((row.impl, row.rank_mode), Counter())
        cell[row.outcome] += 1
        cell["unexplained"] += row.outcome == "FAIL" and not row.finding
    outcomes = [o for o in OUTCOMES if any(c[o] for c in counts.values())]
    lines = ["| implementation | rank mode | " + " | ".join(outcomes) + " | FAIL without a finding | rows |",
             "|---|---|" + "---|" * (len(outcomes) + 2)]
    impls = list(dict.fromkeys(row.impl for row in rows))
    for impl in impls:
        for mode in modes:
            if (impl, mode) in counts:
                cell = counts[(impl, mode)]
                values = [str(cell[o]) for o in outcomes] + [str(cell["unexplained"]),
                                                             str(sum(cell[o] for o in OUTCOMES))]
                lines.append(f"| {impl} | {mode} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"
