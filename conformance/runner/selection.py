"""Selecting matrix rows by id: ``--fsdp-row ID`` and ``--fsdp-rows-from REPORT.json``
(``--fsdp-rows-outcome FAIL,error``).

[Note: row selection]
A row id (``area/name[param=value,...]``, :mod:`conformance.contract.rows`) is
what ``fsdp-conformance list``, the matrix and the JSON report show; it is not
a ``-k`` expression (``=`` and ``,`` are not keyword syntax), so rows are
selected by their own options:

- ``--fsdp-row ID`` (repeatable) runs every cell (implementation x rank mode of
  this run) of each row named;
- ``--fsdp-rows-from REPORT.json`` runs exactly the cells of a previous JSON
  report whose outcome is one of ``--fsdp-rows-outcome`` (default ``FAIL,error``):
  the same row, implementation and rank mode, nothing else.

A renamed row's old id selects the row under its new id ([Note: renamed rows]
in :mod:`conformance.contract.rows`): ``--fsdp-row OLD`` with a
``DeprecationWarning`` and a line on the terminal naming the new id, a
report's rows silently. A row id the collection does not hold, or a report cell this run cannot
reproduce (its implementation or rank mode is not selected), is a usage
error naming it, raised before any case runs. ``-k`` and ``-m`` still apply
on top. Under pytest-xdist the workers collect and the controller does not,
and a usage error raised on a worker surfaces as ``INTERNALERROR ... no
active workers``; so the controller checks ``-k``/``-m`` syntax at configure
time and, when rows are selected, collects once itself to check the ids,
before the workers run anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression  # what -k/-m compile with; no public spelling exists

from conformance.contract.results import OUTCOMES
from conformance.contract.rows import all_params, case_row_id, case_spec, current_row_id, renamed_message, renamed_row
from harness.plugin.workers import is_controller, is_worker

__all__ = ["DEFAULT_OUTCOMES", "Selection", "check_expressions", "report_cells", "selection_of"]

#: Which cells of a report ``--fsdp-rows-from`` re-runs unless ``--fsdp-rows-outcome`` says otherwise.
DEFAULT_OUTCOMES = ("FAIL", "error")

#: A cell of the matrix: (row id, implementation, rank mode).
Cell = tuple[str, str, str]

_SELECTION_KEY = pytest.StashKey["Selection | None"]()
#: What the renamed row ids given to ``--fsdp-row`` warn, for the terminal ([Note: renamed rows]).
_RENAMED_KEY = pytest.StashKey[list[str]]()


@dataclass(frozen=True)
class Selection:
    """The rows (every cell) and the cells (exactly) this run is limited to."""

    rows: frozenset[str]
    cells: frozenset[Cell]
    #: Where ``cells`` came from, for messages (``--fsdp-rows-from PATH``).
    source: str = ""

    def wants(self, cell: Cell) -> bool:
        return cell[0] in self.rows or cell in self.cells


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-conformance")
    group.addoption("--fsdp-row", action="append", default=None, metavar="ID",
                    help="run only this row (an id as 'fsdp-conformance list', the matrix and the JSON show it); "
                    "repeatable")
    group.addoption("--fsdp-rows-from", default=None, metavar="REPORT.json",
                    help="re-run exactly the cells (row, implementation, rank mode) of this JSON report whose "
                    "outcome --fsdp-rows-outcome names")
    group.addoption("--fsdp-rows-outcome", default=None, metavar="OUTCOMES",
                    help=f"with --fsdp-rows-from: comma-separated outcomes to re-run, of {', '.join(OUTCOMES)} "
                    f"(default: {','.join(DEFAULT_OUTCOMES)})")


def _outcomes(raw: str | None, flag: str) -> tuple[str, ...]:
    if raw is None:
        return DEFAULT_OUTCOMES
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    unknown = [name for name in names if name not in OUTCOMES]
    if unknown or not names:
        raise pytest.UsageError(f"{flag}={raw!r}: expected outcomes of {', '.join(OUTCOMES)}, "
                                f"comma-separated; {unknown or 'none given'} is not")
    return names


def report_cells(path: Path, outcomes: Iterable[str]) -> frozenset[Cell]:
    """The cells of the JSON report at ``path`` whose outcome is one of ``outcomes``.

    The rows are the report itself (a list) or its ``rows`` key (an object).
    Raises ``ValueError`` naming the path and what is wrong with it.
    """
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--fsdp-rows-from {str(path)!r}: cannot read a JSON report: {exc}") from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"--fsdp-rows-from {str(path)!r}: expected a list of rows or an object with a 'rows' list")
    wanted = set(outcomes)
    cells: set[Cell] = set()
    for index, row in enumerate(rows):
        try:
            cell = (current_row_id(str(row["case"])), str(row["impl"]), str(row["rank_mode"]))
            outcome = row["outcome"]
        except (TypeError, KeyError) as exc:
            raise ValueError(f"--fsdp-rows-from {str(path)!r}: row {index} lacks {exc} (case, impl, rank_mode, "
                             "outcome)") from None
        if outcome in wanted:
            cells.add(cell)
    return frozenset(cells)


def check_expressions(config: pytest.Config) -> None:
    """A malformed ``-k`` or ``-m`` is a usage error here, in the process the user started."""
    for flag, value in (("-k", config.option.keyword), ("-m", config.option.markexpr)):
        text = (value or "").lstrip()
        if not text:
            continue
        try:
            Expression.compile(text)
        except SyntaxError as exc:
            raise pytest.UsageError(f"{flag} {value!r} is not a valid selection expression: at column "
                                    f"{exc.offset}: {exc.msg} (see pytest's -k/-m syntax; a row id goes to "
                                    "--fsdp-row)") from None


def pytest_configure(config: pytest.Config) -> None:
    check_expressions(config)
    rows = _given_rows(config)
    report = config.getoption("--fsdp-rows-from")
    flag = "--fsdp-rows-outcome"
    outcomes = _outcomes(config.getoption(flag), flag)
    if report is None and config.getoption(flag) is not None:
        raise pytest.UsageError(f"{flag} selects cells of --fsdp-rows-from REPORT.json; give the report")
    cells: frozenset[Cell] = frozenset()
    if report is not None:
        try:
            cells = report_cells(Path(report), outcomes)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        if not cells and not rows and not is_worker(config):
            pytest.exit(f"fsdp-conformance: {report} has no {'/'.join(outcomes)} rows; nothing to re-run",
                        returncode=0)
    selected = rows or cells
    config.stash[_SELECTION_KEY] = Selection(rows, cells, f"--fsdp-rows-from {report}") if selected else None


def _given_rows(config: pytest.Config) -> frozenset[str]:
    """The ``--fsdp-row`` ids, a renamed one as its new id, warning naming it ([Note: renamed rows])."""
    rows: set[str] = set()
    messages: list[str] = []
    for row in config.getoption("--fsdp-row") or ():
        new = renamed_row(row)
        if new is not None:
            messages.append(renamed_message(row, new, "--row"))
            if not is_worker(config):
                config.issue_config_time_warning(DeprecationWarning(messages[-1]), stacklevel=2)
        rows.add(new or row)
    config.stash[_RENAMED_KEY] = messages
    return frozenset(rows)


def pytest_sessionstart(session: pytest.Session) -> None:
    """A line on the terminal for each renamed row id given, before any row runs."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not is_worker(session.config):
        for message in session.config.stash.get(_RENAMED_KEY, []):
            reporter.write_line(f"fsdp-conformance: {message}", yellow=True)


def selection_of(config: pytest.Config) -> Selection | None:
    """This session's row selection, ``None`` when it selects by ``-k`` alone (or not at all)."""
    return config.stash.get(_SELECTION_KEY, None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """An xdist controller collects once itself when rows are selected, so a bad id fails here, not on a worker."""
    if selection_of(session.config) is not None and is_controller(session.config):
        session.perform_collect()


def _cell(item: pytest.Item) -> Cell:
    params = all_params(item)
    return case_row_id(item), str(getattr(params.get("impl"), "name", "")), str(params.get("rank_mode", ""))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the selected cells (before ``-k`` and ``-m``, which apply on top); usage errors name what is unknown."""
    selection = selection_of(config)
    if selection is None:
        return
    cells = {_cell(item): item for item in items if case_spec(item) is not None}
    if not is_worker(config):
        _check_known(selection, cells)
    kept = [item for item in items if case_spec(item) is not None and selection.wants(_cell(item))]
    deselected = [item for item in items if item not in kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


def _check_known(selection: Selection, collected: dict[Cell, Any]) -> None:
    known_rows = {cell[0] for cell in collected}
    unknown = sorted(selection.rows - known_rows)
    if unknown:
        raise pytest.UsageError(f"--fsdp-row: unknown row id(s) {_listed(unknown)}; 'fsdp-conformance list' shows "
                                "the ids")
    gone = sorted({cell[0] for cell in selection.cells} - known_rows)
    if gone:
        raise pytest.UsageError(f"{selection.source}: row(s) {_listed(gone)} are not in this suite")
    missing = sorted(selection.cells - set(collected))
    if missing:
        columns = sorted({f"{impl}/{mode}" for _, impl, mode in missing})
        raise pytest.UsageError(f"{selection.source}: {len(missing)} cell(s) in column(s) {', '.join(columns)} "
                                f"that this run does not select (e.g. {'/'.join(missing[0])}); select those "
                                "implementations (--fsdp-impl) and rank modes (--fsdp-rank-mode)")


def _listed(ids: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")
