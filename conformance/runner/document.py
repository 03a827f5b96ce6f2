"""The JSON report: one versioned document per run, and the one reader of it.

The document's fields, their meaning and the history of the format are in
``docs/REPORTS.md``; :data:`SCHEMA_VERSION` changes whenever a field is
removed, renamed or changes meaning (adding a field does not change it).
The runner, the benchmarks and the tests read reports through :func:`load_report`,
which also reads schemas 2 and 1 (schema 1: the bare list of rows older runs
wrote). The self-test may not import the runner (``test_structure``'s layers), so
:mod:`conformance.selftest.session` and :mod:`conformance.selftest.torch_mutants`
read the row fields they need (``case``, ``impl``, ``rank_mode``, ``outcome``)
from the JSON itself; those fields are the same in every schema.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conformance.contract.results import OUTCOMES, Result
from conformance.contract.rows import current_row_id

if TYPE_CHECKING:
    from conformance.runner.expect import Comparison

__all__ = ["SCHEMA_VERSION", "RunFacts", "RunReport", "load_baseline", "load_report", "machine_facts", "now",
           "render_json", "summary"]

#: 1: a bare JSON list of rows (no version field). 2: this document. 3: the outcome ``documented``.
SCHEMA_VERSION = 3


def now() -> str:
    """The current time as the report writes it: ISO 8601, UTC, seconds."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def machine_facts(gpus: int, nccl: bool) -> dict[str, Any]:
    """Where the run happened: host, OS, CPUs (all and usable), GPUs visible, CUDA build, nccl."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "architecture": platform.machine(),
            "cpus": os.cpu_count(), "usable_cpus": usable, "gpus_visible": gpus,
            "cuda_build": torch.version.cuda, "nccl_available": nccl}


@dataclass(frozen=True)
class RunFacts:
    """What the document says about the run besides its rows."""

    started_at: str
    ended_at: str
    #: setting name -> ``{"value": ..., "source": ...}`` (:mod:`conformance.runner.settings`).
    settings: Mapping[str, Mapping[str, Any]]
    machine: Mapping[str, Any]
    #: The signal that stopped the run (``SIGTERM``, ``SIGINT``, ``SIGHUP``), or ``None``.
    interrupted_by: str | None = None
    torch: str = field(default_factory=lambda: _torch_version())
    python: str = field(default_factory=platform.python_version)
    #: Cells (case x implementation x rank mode) the run selected; ``None`` when it never learnt how many.
    selected_rows: int | None = None
    #: This suite's version (:func:`conformance.runner.versions.suite_version`).
    tool_version: str = field(default_factory=lambda: _suite_version())
    #: Per adapter: name, target, distribution and version (:func:`conformance.runner.versions.adapter_facts`).
    adapters: Sequence[Mapping[str, Any]] = ()
    #: The run compared with ``--conformance-expect``'s baseline (:mod:`conformance.runner.expect`), or ``None``.
    expectation: Comparison | None = None
    #: A launched job's layout ([Note: job layout] in :mod:`harness.ranks.launched`): ``nodes``,
    #: ``local_world_size``, ``world_size``; ``None`` for process and thread ranks.
    topology: Mapping[str, int] | None = None

    def incomplete_reason(self, rows: int) -> str | None:
        """Why a report of ``rows`` rows is not complete, or ``None`` when every selected row is in it and
        the run was not stopped. A run that does not know how many rows it selected is not complete."""
        if self.interrupted_by is not None:
            return f"stopped by {self.interrupted_by} after {rows} rows; rows not listed did not run"
        if self.selected_rows is None:
            return f"{rows} rows reported, and the run did not learn how many it selected"
        if rows < self.selected_rows:
            return (f"{self.selected_rows - rows} of {self.selected_rows} selected rows have no outcome (the run "
                    "ended before them, or they ended without one)")
        return None


def _suite_version() -> str:
    from conformance.runner.versions import suite_version

    return suite_version()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _expectation(comparison: Comparison | None) -> dict[str, Any] | None:
    from conformance.runner.expect import to_document

    return None if comparison is None else to_document(comparison)


def summary(results: Sequence[Result]) -> dict[str, Any]:
    """Rows per outcome (every outcome present, zeros included), the row count and the case time."""
    counts = {outcome: 0 for outcome in OUTCOMES}
    for r in results:
        counts[r.outcome] += 1
    return {"rows": len(results), **counts, "case_time_s": round(sum(r.duration_s for r in results), 3)}


def render_json(results: Sequence[Result], facts: RunFacts) -> str:
    """The schema-2 document (``docs/REPORTS.md``) as text."""
    interrupted = facts.interrupted_by is not None
    placements = sorted({r.placement for r in results if r.placement})
    incomplete = facts.incomplete_reason(len(results))
    document = {
        "schema_version": SCHEMA_VERSION,
        "tool": "fsdp-conformance",
        "tool_version": facts.tool_version,
        "torch": facts.torch,
        "python": facts.python,
        "adapters": [dict(adapter) for adapter in facts.adapters],
        "machine": dict(facts.machine),
        "placements": placements,
        "settings": {name: dict(value) for name, value in facts.settings.items()},
        "started_at": facts.started_at,
        "ended_at": facts.ended_at,
        "complete": incomplete is None,
        "incomplete_reason": incomplete,
        "selected_rows": facts.selected_rows,
        "interrupted": interrupted,
        "interrupted_by": facts.interrupted_by,
        "outcomes": list(OUTCOMES),
        "summary": summary(results),
        "expectation": _expectation(facts.expectation),
        "topology": None if facts.topology is None else dict(facts.topology),
        "rows": [asdict(r) for r in results],
    }
    return json.dumps(document, indent=2) + "\n"


@dataclass(frozen=True)
class RunReport:
    """A report as read back: its schema version, the document's other fields, and the rows."""

    schema_version: int
    header: Mapping[str, Any]
    rows: list[Result]

    @property
    def complete(self) -> bool:
        """Whether every selected row ran (schema 1 did not say; its reports count as complete)."""
        return bool(self.header.get("complete", True))


_ROW_FIELDS = frozenset(f.name for f in fields(Result))


def load_report(path: Path) -> RunReport:
    """Read a JSON report of schema 1 or 2; errors name the path and what is wrong."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON report: {exc}") from exc
    rows: Any
    if isinstance(data, list):
        version, header, rows = 1, {}, data
    elif isinstance(data, dict) and isinstance(data.get("schema_version"), int):
        version, rows = data["schema_version"], data.get("rows")
        header = {k: v for k, v in data.items() if k != "rows"}
        if version > SCHEMA_VERSION:
            raise ValueError(f"{path}: schema_version {version} is newer than this reader's {SCHEMA_VERSION}")
    else:
        raise ValueError(f"{path}: expected a report object with schema_version (or a schema-1 list of rows)")
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path}: 'rows' must be a list of row objects")
    try:
        results = [Result(**{k: v for k, v in row.items() if k in _ROW_FIELDS}) for row in rows]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: a row is malformed: {exc}") from exc
    return RunReport(version, header, results)


def load_baseline(path: Path, flag: str) -> RunReport:
    """The report at ``path`` as a baseline to compare a run with ([Note: expected outcomes] in
    :mod:`conformance.runner.expect`), a renamed row under its new id ([Note: renamed rows] in
    :mod:`conformance.contract.rows`); ``ValueError`` naming ``flag`` and the path when it cannot serve."""
    try:
        report = load_report(path)
    except ValueError as exc:
        raise ValueError(f"{flag} {str(path)!r}: not a baseline: {exc}") from None
    if not report.rows:
        raise ValueError(f"{flag} {str(path)!r}: not a baseline: the report has no rows to compare with; give "
                         "the JSON report of a run that ran rows")
    rows = [replace(row, case=current_row_id(row.case)) for row in report.rows]
    return RunReport(report.schema_version, report.header, rows)
