"""Known, investigated disagreements between an implementation and a case.

A known bug does not change an outcome: the case still reports FAIL, and the
matrix reason points at the write-up (minimal repro, exact output, why the
case is right) so a reader does not have to rediscover it. A documented choice
(``kind="documented"``, below) makes the cell ``documented``: the
implementation does what its own documentation says, which is neither a pass
nor a violation.

Findings share one format (a JSON list of
``{"impl": ..., "rows": ..., "doc": ...}``, ``rows`` a pattern as
:func:`conformance.contract.rows.row_matches` reads it, ``doc`` a path or URL; an
optional ``"reason"``, a regular expression, limits the finding to failures
whose reason it matches: a row that can fail for more than one cause, such as
a fuzzer row, is explained only for the cause the write-up describes; an
optional ``"component"`` names the component at fault when it is not the
implementation itself, e.g. ``"torch.distributed.checkpoint.state_dict"``; an
optional ``"kind"`` is ``"bug"``, the default, or ``"documented"``: a
limitation or design choice the implementation's own documentation states,
which then needs ``"documentation"``, the citation (document, section or quote,
version); the reason then says it is documented and cites where; an optional
``"set_aside"``, a list of names, is what a fuzzer row's search leaves out of the
programs it draws once it met the finding, so that it reaches past it (the
stateful fuzzer's configuration features and operations, e.g. ``["cpu_offload"]``
or ``["Load"]``: [Note: known findings in a search] in
:mod:`conformance.fuzz.known`); without it nothing is set aside and the search
goes on drawing as it would have). A ``rows``
naming a renamed row's old id applies to the row under its new id, with a
``DeprecationWarning`` naming it ([Note: renamed rows] in
:mod:`conformance.contract.rows`). They come from three places:

- this suite's own, :data:`BUILTIN_FILE`;
- packages, under the :data:`ENTRY_POINT_GROUP` entry-point group: the entry
  point names a list of :class:`Finding` (or of such mappings) or a callable
  returning one, e.g. ``my-fsdp = "my_fsdp.conformance:FINDINGS"``;
- files named in :data:`ENV_VAR` (``os.pathsep``-separated paths).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from conformance.contract.case import KnownFailure
from conformance.contract.rows import all_params, case_row_id, case_spec, current_row_id, parse_row_id, row_matches

__all__ = ["BUILTIN_FILE", "ENTRY_POINT_GROUP", "ENV_VAR", "KINDS", "Finding", "annotate", "explaining", "known",
           "load_file", "load_files", "registered_for"]

BUILTIN_FILE = Path(__file__).with_name("known_findings.json")
ENTRY_POINT_GROUP = "fsdp_conformance.findings"
ENV_VAR = "FSDP_CONFORMANCE_FINDINGS"


_REQUIRED = frozenset({"impl", "rows", "doc"})
_OPTIONAL = frozenset({"reason", "component", "kind", "documentation", "set_aside"})
#: ``kind``: an implementation's (or ``component``'s) bug, or a limitation its documentation states.
KINDS = ("bug", "documented")


@dataclass(frozen=True)
class Finding:
    """A FAIL of ``impl`` on the rows ``rows`` matches is explained by ``doc`` (only a FAIL whose
    reason matches the regular expression ``reason``, when one is given)."""

    impl: str
    rows: str
    doc: str
    reason: str | None = None
    #: The component at fault when it is not ``impl`` itself (``None``: the implementation).
    component: str | None = None
    #: One of :data:`KINDS`.
    kind: str = "bug"
    #: For ``kind="documented"``: where the implementation documents the behaviour (document, section or
    #: quote, version).
    documentation: str | None = None
    #: What a fuzzer's search leaves out of later draws once it met this finding (see the module docstring).
    set_aside: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # a registration naming a renamed row's old id ([Note: renamed rows]); frozen, hence object.__setattr__
        object.__setattr__(self, "rows", current_row_id(self.rows, f"finding for {self.impl}", stacklevel=4))
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "documented") != (self.documentation is not None):
            raise ValueError("'documentation' (the citation) is given exactly when kind is 'documented', "
                             f"got kind={self.kind!r}, documentation={self.documentation!r}")

    @classmethod
    def from_mapping(cls, entry: Mapping[str, Any], source: str) -> Finding:
        """Validate one entry; errors name ``source`` and the entry."""
        if not isinstance(entry, Mapping) or not _REQUIRED <= set(entry) <= _REQUIRED | _OPTIONAL:
            raise ValueError(f"{source}: a finding is {{'impl', 'rows', 'doc'}} and optionally 'reason', "
                             f"'component', 'kind', 'documentation' and 'set_aside', got {entry!r}")
        if not all(isinstance(v, str) and v for k, v in entry.items() if k != "set_aside"):
            raise ValueError(f"{source}: every field of a finding but 'set_aside' must be a non-empty string, "
                             f"got {entry!r}")
        set_aside = entry.get("set_aside", [])
        if not isinstance(set_aside, list) or not all(isinstance(name, str) and name for name in set_aside):
            raise ValueError(f"{source}: 'set_aside' must be a list of non-empty names, got {set_aside!r}: {entry!r}")
        try:
            parse_row_id(entry["rows"])  # a malformed pattern fails here, not when a case fails
        except ValueError as exc:
            raise ValueError(f"{source}: rows: {exc}") from None
        if "reason" in entry:
            try:
                re.compile(entry["reason"])
            except re.error as exc:
                raise ValueError(f"{source}: reason {entry['reason']!r} is not a regular expression: {exc}") from None
        try:
            rows = current_row_id(entry["rows"], f"{source}: finding for {entry['impl']}", stacklevel=3)
            return cls(entry["impl"], rows, entry["doc"], entry.get("reason"), entry.get("component"),
                       entry.get("kind", "bug"), entry.get("documentation"), tuple(set_aside))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}: {entry!r}") from None

    def known_failure(self) -> KnownFailure:
        """This finding as a case body sees it (:attr:`CaseSettings.known_failures
        <conformance.contract.case.CaseSettings.known_failures>`)."""
        return KnownFailure(self.doc, self.reason, self.set_aside)

    def label(self) -> str:
        """How a reason it explains starts: ``known finding``, the component at fault, and for a documented
        limitation the citation."""
        at = f" in {self.component}" if self.component else ""
        if self.kind == "documented":
            return f"known finding{at}, documented limitation ({self.documentation}), see {self.doc}"
        return f"known finding{at}, see {self.doc}"

    def explains(self, impl: str, case: str, reason: str) -> bool:
        """Whether this finding is the known cause of ``impl`` failing ``case`` with ``reason``."""
        return (self.impl == impl and row_matches(case, self.rows)
                and (self.reason is None or re.search(self.reason, reason) is not None))


def load_file(path: Path) -> list[Finding]:
    """The findings in a JSON file (a list of entries)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read findings: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of findings, got {type(data).__name__}")
    return [Finding.from_mapping(entry, str(path)) for entry in data]


def load_files(raw: str) -> tuple[str, ...]:
    """The paths of a :data:`ENV_VAR` value (``os.pathsep``-separated), each read and validated; ``ValueError``
    naming the first file that cannot be read, is not JSON or holds a malformed finding (the run's settings
    check the variable with it before any row runs)."""
    paths = tuple(filter(None, (part.strip() for part in str(raw).split(os.pathsep))))
    for path in paths:
        load_file(Path(path))
    return paths


def _from_entry_points() -> list[Finding]:
    found: list[Finding] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        source = f"entry point {ep.name} ({ep.value})"
        value = ep.load()
        entries: Iterable[Any] = value() if callable(value) else value
        found += [e if isinstance(e, Finding) else Finding.from_mapping(e, source) for e in entries]
    return found


def known() -> list[Finding]:
    """Every registered finding: built-in, entry points, then :data:`ENV_VAR` files."""
    found = load_file(BUILTIN_FILE) + _from_entry_points()
    for part in filter(None, os.environ.get(ENV_VAR, "").split(os.pathsep)):
        found += load_file(Path(part))
    return found


def registered_for(item: Any) -> tuple[KnownFailure, ...]:
    """The findings registered for a conformance row's implementation and row (its ``case_settings``), whatever
    the reason, as its body sees them; none for a test that is no conformance row."""
    impl = getattr(all_params(item).get("impl"), "name", None)
    if impl is None or case_spec(item) is None:
        return ()
    case = case_row_id(item)
    return tuple(f.known_failure() for f in known() if f.impl == impl and row_matches(case, f.rows))


def explaining(impl: str, case: str, reason: str) -> Finding | None:
    """The first registered finding that explains ``impl`` failing ``case`` with ``reason``, if any."""
    return next((f for f in known() if f.explains(impl, case, reason)), None)


def annotate(impl: str, case: str, reason: str, finding: Finding | None = None) -> str:
    """``reason``, prefixed with the finding's write-up when this failure is a known one
    (``finding`` when the caller already looked it up with :func:`explaining`)."""
    finding = finding or explaining(impl, case, reason)
    return reason if finding is None else f"{finding.label()}: {reason}"
