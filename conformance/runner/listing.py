"""The case rows a selection holds, with what each requires and, per adapter, why it would be ``n/a``.

Backs ``fsdp-conformance list`` (and ``list --impl NAME``, the preview of an
implementation's ``n/a`` rows); it collects the cases without running them.
"""

from __future__ import annotations

import contextlib
import inspect
import io
from dataclasses import dataclass, field

import pytest

from conformance.contract.adapter import Capability
from conformance.contract.applicability import not_applicable_reason
from conformance.contract.case import CaseSettings
from conformance.contract.clauses import describe
from conformance.contract.rows import all_params, case_row_id, case_spec
from conformance.runner import CASES_DIR, PYTEST_PLUGIN

__all__ = ["CASES_DIR", "ListedRow", "collect_rows"]



@dataclass
class ListedRow:
    """One matrix row: its hardware needs, declared rank modes, required capabilities, and n/a reasons."""

    row_id: str
    needs: str
    modes: tuple[str, ...]
    #: Seconds its ranks may take by default (``--case-timeout`` replaces it).
    timeout_s: float
    requires: set[Capability] = field(default_factory=set)
    #: Capabilities the row also exercises where the adapter declares them (``@case(uses=...)``).
    uses: set[Capability] = field(default_factory=set)
    #: rank mode -> why the row is n/a there for the adapter given to :func:`collect_rows`.
    not_applicable: dict[str, str] = field(default_factory=dict)
    #: rank mode -> why the row would be an ``error`` there (as ``run`` reports it: the adapter fails to load).
    errors: dict[str, str] = field(default_factory=dict)
    #: What the row asserts: the contract clauses its case names (``@case(clause=...)``: id, title and
    #: citation, one a line), then its case's docstring (``list --explain``).
    asserts: str = ""
    #: The contract clauses the row's case asserts, as :func:`conformance.contract.clauses.describe` gives them.
    clauses: list[str] = field(default_factory=list)

    def text(self) -> str:
        line = f"{self.needs}; modes {'/'.join(self.modes)}; timeout {self.timeout_s:g} s"
        if self.requires:
            line += f"; requires {', '.join(sorted(str(c) for c in self.requires))}"
        if self.uses:
            line += f"; uses where declared {', '.join(sorted(str(c) for c in self.uses))}"
        for outcome, reasons in (("error", self.errors), ("n/a", self.not_applicable)):
            for reason in dict.fromkeys(reasons.values()):
                modes = [m for m, r in reasons.items() if r == reason]
                line += f"; {outcome} ({'/'.join(modes)}): {reason}"
        return line


class _Collector:
    """A pytest plugin that turns the collected items into :class:`ListedRow` values."""

    def __init__(self) -> None:
        self.rows: dict[str, ListedRow] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            spec = case_spec(item)
            if spec is None:
                continue
            params = all_params(item)
            row = self.rows.setdefault(case_row_id(item), ListedRow(case_row_id(item), spec.needs_text(params),
                                                                    spec.modes, spec.timeout(CaseSettings())))
            row.requires.update(spec.required(params))
            row.uses.update(spec.uses)
            row.clauses = [describe(ref) for ref in spec.clauses]
            row.asserts = _asserts(row.clauses, getattr(getattr(item, "function", None), "__doc__", None) or "")
            impl = params.get("impl")
            mode = str(params.get("rank_mode"))
            if impl is None:
                continue
            if not hasattr(impl, "capabilities"):  # an adapter that failed to load: run says error, so does list
                row.errors[mode] = f"adapter {impl.name!r} failed to load: {getattr(impl, 'error', impl)}"
                continue
            reason = not_applicable_reason(spec, impl, params)
            if reason is not None:
                row.not_applicable[mode] = reason


def _asserts(clauses: list[str], doc: str) -> str:
    """What ``list --explain`` prints of a row: the clauses its case asserts, then the case's docstring."""
    heading = "\n".join(f"clause {line}" for line in clauses) or "clause: none declared"
    return f"{heading}\n\n{inspect.cleandoc(doc)}".rstrip()


def collect_rows(keyword: str | None = None, impl: str | None = None) -> list[ListedRow]:
    """Every row of the cases matching ``keyword``; with ``impl``, its n/a reasons in both rank modes.

    Raises ``ValueError`` (a usage error) when a setting is bad, ``RuntimeError`` with pytest's output when
    collection fails.
    """
    collector = _Collector()
    args = [str(CASES_DIR), "--collect-only", "-qq", "-p", "no:cacheprovider", "-p", PYTEST_PLUGIN,
            "--fsdp-rank-mode", "both"]
    if keyword:
        args += ["-k", keyword]
    if impl:
        args += ["--fsdp-impl", impl]
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = int(pytest.main(args, plugins=[collector]))
    if code == int(pytest.ExitCode.USAGE_ERROR):  # a bad setting: pytest has printed it, naming its source
        raise ValueError(f"a setting is bad (above); nothing was listed\n{captured.getvalue()[-4000:]}".rstrip())
    if code not in (0, int(pytest.ExitCode.NO_TESTS_COLLECTED)):
        raise RuntimeError(f"collecting cases failed (exit {code}):\n{captured.getvalue()[-4000:]}")
    return list(collector.rows.values())
