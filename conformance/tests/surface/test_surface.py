"""docs/SURFACE.md and its classification hold for the installed torch ([Note: the surface table] in
conformance/surface/__init__.py): every public name classified, every citation a row that runs on the
surface's adapter, the page the generator's output. Not ``first_torch``: a new torch's names are what
it checks."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from conformance.runner.listing import ListedRow, collect_rows
from conformance.surface.classification import CLASSIFIED, Citation, Entry, Surface, load, parse_citation
from conformance.surface.collect import installed_surfaces
from conformance.surface.compare import problems
from conformance.surface.render import render

PAGE = Path(__file__).resolve().parents[3] / "docs" / "SURFACE.md"
PERFORMANCE_KNOB = ("performance knob; no neutrality check yet (turning it on must not change outputs, gradients, "
                    "parameters or state dicts)")
SURFACES = load()


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _entries() -> list[tuple[Surface, Entry]]:
    return [(surface, entry) for surface in SURFACES for entry in surface.entries]


def test_installed_surface_is_classified() -> None:
    """Every public name of the installed torch has an entry of its kind, and every entry that holds for this
    torch names one of its public names."""
    found = problems(SURFACES, installed_surfaces(), _torch_version())
    assert not found, "\n".join(found)


def test_problems_name_a_new_public_name() -> None:
    """A name a new torch adds, and one it removes, are reported by surface and name."""
    installed = installed_surfaces()
    installed["FSDPModule"] = {**installed["FSDPModule"], "set_new_knob": "method"}
    del installed["fully_shard"]["mesh"]
    found = problems(SURFACES, installed, _torch_version())
    assert any("FSDPModule.set_new_knob (method)" in line for line in found), found
    assert any("fully_shard.mesh is classified" in line for line in found), found


def test_versions_decide_presence() -> None:
    entry = Entry("x", "method", unexercised="no row", since="2.14", until="2.16")
    assert [entry.present_in(v) for v in ((2, 13), (2, 14), (2, 15), (2, 16))] == [False, True, True, False]


def test_page_is_the_generators_output() -> None:
    assert PAGE.read_text() == render(SURFACES), (
        f"{PAGE.name} is not what {CLASSIFIED.name} renders to: "
        "run python -m conformance.surface --write docs/SURFACE.md")


def test_no_entry_says_not_observable() -> None:
    said = [f"{surface.name}.{entry.name}" for surface, entry in _entries()
            if "not observable" in f"{entry.check} {entry.unexercised}".lower()]
    assert not said, f"entries saying 'not observable' (say what no case checks yet instead): {said}"


def test_performance_knobs_say_no_neutrality_check() -> None:
    """An unexercised performance knob gives the one reason that names the missing neutrality check."""
    loose = [f"{surface.name}.{entry.name}: {entry.unexercised!r}" for surface, entry in _entries()
             if "performance" in entry.unexercised and entry.unexercised != PERFORMANCE_KNOB]
    assert not loose, f"performance knobs must say exactly {PERFORMANCE_KNOB!r}: {loose}"


def test_citation_matching() -> None:
    rows = ["state_dict/roundtrip[kind=FULL]", "state_dict/roundtrip_more", "fuzz/stateful_ws2"]
    assert [r for r in rows if parse_citation("state_dict/roundtrip").matches(r)] == rows[:1]
    assert [r for r in rows if parse_citation("state_dict/roundtrip[kind=*]").matches(r)] == rows[:1]
    assert parse_citation("fuzz/stateful_* op Unshard") == Citation("fuzz/stateful_*", "Unshard")
    with pytest.raises(ValueError, match="'fuzz/stateful_\\* op'"):
        parse_citation("fuzz/stateful_* op")


def _operations() -> set[str]:
    """The class names of the stateful fuzzer's operations (its ``Op`` union)."""
    from conformance.fuzz import ops

    return {cls.__name__ for cls in typing.get_args(ops.Op)}


def test_cited_operations_exist() -> None:
    operations = _operations()
    unknown = [f"{surface.name}.{entry.name}: {citation}" for surface, entry in _entries()
               for citation in entry.exercised_by if citation.op is not None and citation.op not in operations]
    assert not unknown, f"citations of operations the stateful fuzzer does not have ({sorted(operations)}): {unknown}"


@pytest.fixture(scope="module")
def rows_by_adapter() -> dict[str, list[ListedRow]]:
    return {adapter: collect_rows(impl=adapter) for adapter in sorted({surface.adapter for surface in SURFACES})}


def _runs(row: ListedRow) -> bool:
    return any(mode not in row.not_applicable and mode not in row.errors for mode in row.modes)


def test_cited_rows_run_on_the_surface_adapter(rows_by_adapter: dict[str, list[ListedRow]]) -> None:
    """Every citation matches a row of the suite, and every row it matches runs (in some rank mode) on the
    adapter through which its surface is reached."""
    found = []
    for surface, entry in _entries():
        rows = rows_by_adapter[surface.adapter]
        for citation in entry.exercised_by:
            matched = [row for row in rows if citation.matches(row.row_id)]
            idle = [f"{row.row_id} ({'; '.join(dict.fromkeys(row.not_applicable.values()))})"
                    for row in matched if not _runs(row)]
            if not matched:
                found.append(f"{surface.name}.{entry.name} cites {citation}: no row matches")
            elif idle:
                found.append(f"{surface.name}.{entry.name} cites {citation}: n/a on {surface.adapter}: {idle}")
    assert not found, "\n".join(found)
