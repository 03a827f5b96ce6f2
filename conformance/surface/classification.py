"""The classification of torch's FSDP surface (``classified.toml``), read into frozen dataclasses.

Each surface names the adapter through which the suite reaches it (``adapter``) and holds one entry per
public name: its ``kind``, and either ``exercised_by`` (citations) with ``check`` (what is asserted) or
``unexercised`` (why nothing is), and optionally ``since``/``until`` (see :mod:`conformance.surface`).

A citation is ``ROWS`` or ``ROWS op OPERATION``: ``ROWS`` is a row id as ``fsdp-conformance list``
prints it, a case id without its parameters (every row of the case), or either with ``*`` matching any
characters; ``OPERATION`` is the class name of a stateful-fuzzer operation (``Unshard``, ``Save``, ...)
that the rows run.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CLASSIFIED", "Citation", "Entry", "Surface", "load", "parse_citation"]

CLASSIFIED = Path(__file__).with_name("classified.toml")
_KEYS = frozenset({"kind", "exercised_by", "check", "unexercised", "since", "until"})
_CITATION = re.compile(r"(?P<rows>\S+)(?: op (?P<op>[A-Z]\w*))?")
_VERSION = re.compile(r"\d+\.\d+")


@dataclass(frozen=True)
class Citation:
    """``rows`` (a row id, a case id or a pattern with ``*``), and the fuzzer operation named, if any."""

    rows: str
    op: str | None = None

    def matches(self, row_id: str) -> bool:
        """Whether ``row_id`` is one of the rows cited."""
        pattern = re.escape(self.rows).replace(r"\*", ".*")
        return re.fullmatch(pattern, row_id) is not None or row_id.startswith(f"{self.rows}[")

    def __str__(self) -> str:
        return self.rows if self.op is None else f"{self.rows} op {self.op}"


@dataclass(frozen=True)
class Entry:
    """One public name: exercised (``exercised_by`` and ``check``) or not (``unexercised``)."""

    name: str
    kind: str
    exercised_by: tuple[Citation, ...] = ()
    check: str = ""
    unexercised: str = ""
    since: str | None = None
    until: str | None = None

    @property
    def exercised(self) -> bool:
        return bool(self.exercised_by)

    def present_in(self, version: tuple[int, int]) -> bool:
        """Whether torch ``version`` (major, minor) has the name: ``since`` <= version < ``until``."""
        low = _version(self.since) if self.since else (0, 0)
        high = _version(self.until) if self.until else (10**6, 0)
        return low <= version < high


@dataclass(frozen=True)
class Surface:
    """A group of public names (a class's members or fields, a callable's arguments, a module's functions)."""

    name: str
    adapter: str
    entries: tuple[Entry, ...]

    def entry(self, name: str) -> Entry | None:
        return next((entry for entry in self.entries if entry.name == name), None)


def parse_citation(text: str) -> Citation:
    """``ROWS`` or ``ROWS op OPERATION``; ``ValueError`` naming ``text`` otherwise."""
    match = _CITATION.fullmatch(text)
    if match is None:
        raise ValueError(f"citation {text!r} is not 'ROWS' or 'ROWS op OPERATION'")
    return Citation(match["rows"], match["op"])


def load(path: Path = CLASSIFIED) -> list[Surface]:
    """Every surface of ``path``, in its order; ``ValueError`` naming the surface and name of a bad entry."""
    with path.open("rb") as file:
        data = tomllib.load(file)
    surfaces = []
    for surface, table in data.items():
        adapter = table.get("adapter")
        if not isinstance(adapter, str):
            raise ValueError(f"{path.name}: surface {surface!r} names no adapter (adapter = \"...\")")
        entries = tuple(_entry(f"{surface}.{name}", name, value) for name, value in table.items()
                        if name != "adapter")
        surfaces.append(Surface(surface, adapter, entries))
    return surfaces


def _entry(where: str, name: str, value: Any) -> Entry:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a table of {sorted(_KEYS)}, got {value!r}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected some of {sorted(_KEYS)}")
    cited = value.get("exercised_by", [])
    if bool(cited) == bool(value.get("unexercised")) or bool(cited) != bool(value.get("check")):
        raise ValueError(f"{where}: give exercised_by with check, or unexercised (the reason), not both: {value!r}")
    for bound in ("since", "until"):
        if bound in value and not _VERSION.fullmatch(str(value[bound])):
            raise ValueError(f"{where}: {bound} = {value[bound]!r} is not a torch version MAJOR.MINOR")
    if "kind" not in value:
        raise ValueError(f"{where}: no kind")
    return Entry(name=name, kind=value["kind"], exercised_by=tuple(parse_citation(c) for c in cited),
                 check=value.get("check", ""), unexercised=value.get("unexercised", ""),
                 since=value.get("since"), until=value.get("until"))


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)
