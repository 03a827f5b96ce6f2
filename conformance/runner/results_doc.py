"""docs/CONFORMANCE.md's numbers, rendered from the JSON report of the run they describe.

[Note: generated results]
The results page states what one run found, and that run's JSON report is
committed beside it (``docs/results/cpu.json``, written by ``--publish``: the
report without the machine's host name). Between a line
``<!-- generated: NAME -->`` and a line ``<!-- end generated: NAME -->`` the
page holds exactly what :func:`render_blocks` makes of that report: ``facts``
(when, on what software and machine, with which adapters at which versions,
how many rows), ``summary`` (outcome counts per area and implementation, then
every FAIL, error and documented cell: :func:`conformance.runner.summarize.summarize`),
``modes`` (outcome counts per implementation and rank mode, with the FAILs no
finding explains), ``findings`` (the index of known findings: [Note: generated
findings index] in :mod:`conformance.runner.findings_index`, read from the
suite's ``known_findings.json`` and the report's rows) and ``matrix`` (every
cell, then the reason of each that did not pass:
:func:`conformance.runner.report.render_markdown`, columns in the run's adapter
order, process ranks first). ``python -m conformance.runner.results_doc
REPORT PAGE`` rewrites the blocks, ``--check`` exits 1 naming each block that
differs, and ``test_results_doc`` checks the committed page against the
committed report, so no number on the page is typed by hand. The prose
around the blocks says how to read them and carries no counts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance.contract.results import Result
from conformance.runner.document import RunReport, load_report
from conformance.runner.findings import BUILTIN_FILE, Finding, load_file
from conformance.runner.findings_index import render_findings, render_modes
from conformance.runner.report import render_markdown
from conformance.runner.summarize import summarize

__all__ = ["BLOCKS", "main", "publish", "render_blocks", "replace_blocks"]

#: The generated blocks, in the order the page has them.
BLOCKS = ("facts", "summary", "modes", "findings", "matrix")
_MODES = ("process", "thread", "launched")
#: The project's root: the findings' ``doc`` paths are relative to it.
ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated: \2 -->)", re.DOTALL)


def _ordered(report: RunReport) -> list[Result]:
    """The rows with the run's adapters in its selection order, process ranks first, so that the matrix's
    columns do not depend on the order pytest-xdist finished the rows in."""
    order = [adapter["name"] for adapter in report.header.get("adapters", [])]
    impls = order + sorted({r.impl for r in report.rows} - set(order))
    return sorted(report.rows, key=lambda r: (impls.index(r.impl), _MODES.index(r.rank_mode), r.case))


def _facts(header: Mapping[str, Any], rows: Sequence[Result]) -> str:
    machine = header.get("machine", {})
    adapters = ", ".join(
        f"{a['name']} ({a['distribution']} {a['version']})" if a.get("distribution") else a["name"]
        for a in header.get("adapters", []))
    gpus = machine.get("gpus_visible", 0)
    os_name = str(machine.get("platform", "")).split("-")[0]  # the system, not its kernel build
    complete = "complete" if header.get("complete", True) else f"incomplete: {header.get('incomplete_reason')}"
    return (f"{len(rows)} rows ({complete}), run from {header.get('started_at')} to {header.get('ended_at')} "
            f"(UTC) on a {machine.get('cpus')}-core {machine.get('architecture')} {os_name} box "
            f"with {gpus or 'no'} GPU{'s' if gpus != 1 else ''}: Python {header.get('python')}, torch "
            f"{header.get('torch')}, fsdp-conformance {header.get('tool_version')}; adapters: {adapters}.\n")


def render_blocks(report: RunReport, findings: Sequence[Finding] | None = None,
                  root: Path = ROOT) -> dict[str, str]:
    """Each generated block's text for ``report``; ``findings`` are the registered ones the index lists (the
    suite's ``known_findings.json`` when ``None``), their write-ups' paths relative to ``root``."""
    rows = _ordered(report)
    registered = load_file(BUILTIN_FILE) if findings is None else findings
    return {"facts": _facts(report.header, rows), "summary": summarize(rows),
            "modes": render_modes(rows, _MODES), "findings": render_findings(registered, rows, root),
            "matrix": render_markdown(rows, title="Full matrix")}


def replace_blocks(page: str, blocks: Mapping[str, str]) -> tuple[str, list[str]]:
    """``page`` with each generated block replaced, and the names of the blocks that changed; ``ValueError``
    naming a block of :data:`BLOCKS` the page lacks or one it has that is not known."""
    found = [match.group(2) for match in _BLOCK.finditer(page)]
    unknown, missing = sorted(set(found) - set(blocks)), [name for name in blocks if name not in found]
    if unknown or missing:
        raise ValueError(f"generated blocks: missing {missing}, unknown {unknown} (markers: "
                         "'<!-- generated: NAME -->' ... '<!-- end generated: NAME -->')")
    changed = [m.group(2) for m in _BLOCK.finditer(page) if m.group(3) != blocks[m.group(2)]]
    return _BLOCK.sub(lambda m: m.group(1) + blocks[m.group(2)] + m.group(4), page), changed


def publish(source: Path, dest: Path) -> None:
    """Write the report at ``source`` to ``dest`` as it is committed: without the machine's host name."""
    data = json.loads(source.read_text())
    data.get("machine", {}).pop("hostname", None)
    dest.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.runner.results_doc",
                                     description="Render a results page's generated blocks from a JSON report.")
    parser.add_argument("report", type=Path, help="the run's JSON report (fsdp-conformance run --json)")
    parser.add_argument("page", type=Path, help="the page holding the blocks, e.g. docs/CONFORMANCE.md")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming blocks that differ")
    parser.add_argument("--publish", type=Path, metavar="DEST",
                        help="first write the report to DEST as it is committed (no host name), then render from it")
    args = parser.parse_args(argv)
    if args.publish is not None:
        publish(args.report, args.publish)
    source = args.publish or args.report
    try:
        page, changed = replace_blocks(args.page.read_text(), render_blocks(load_report(source)))
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.check:
        for name in changed:
            print(f"{args.page}: block {name!r} differs from {source}", file=sys.stderr)
        return 1 if changed else 0
    args.page.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
