"""Every case names the contract clause it asserts, and every clause is a heading of docs/CONTRACT.md."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from conformance.contract.case import CaseSpec, DocCitation, case
from conformance.contract.clauses import CLAUSES, TORCH_VERSION, describe
from conformance.runner.cli import main
from conformance.runner.listing import CASES_DIR

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

CONTRACT = Path(__file__).resolve().parents[3] / "docs" / "CONTRACT.md"
_HEADING = re.compile(r"^## (C[0-9]+)\. (.+)$")


def _headings() -> dict[str, str]:
    """Clause id -> title, from docs/CONTRACT.md's ``## C<n>. Title`` headings."""
    found = [m.groups() for m in map(_HEADING.match, CONTRACT.read_text().splitlines()) if m]
    ids = [cid for cid, _ in found]
    assert len(ids) == len(set(ids)), f"docs/CONTRACT.md repeats a clause id: {ids}"
    return dict(found)


def _case_specs() -> list[CaseSpec]:
    """Every case the suite declares, from its ``conformance`` mark."""
    specs = []
    for path in sorted(CASES_DIR.glob("test_*.py")):
        module = importlib.import_module(f"conformance.cases.{path.stem}")
        specs += [m.args[0] for fn in vars(module).values() for m in getattr(fn, "pytestmark", ())
                  if m.name == "conformance"]
    return specs


def test_every_case_names_a_clause() -> None:
    """A case without ``clause=`` fails here, naming it."""
    specs = _case_specs()
    assert len(specs) >= 80, f"found only {len(specs)} cases: the collection above is broken"
    unclaused = sorted(spec.id for spec in specs if not spec.clauses)
    assert not unclaused, f"cases that name no contract clause (@case(..., clause=...)): {unclaused}"


def test_every_clause_is_a_heading_of_the_contract() -> None:
    """The clause ids the cases use, and every clause the code knows, are headings of docs/CONTRACT.md with the
    same titles; every heading is a clause the code knows."""
    headings = _headings()
    used = {ref for spec in _case_specs() for ref in spec.clauses if isinstance(ref, str)}
    assert used, "no case names a clause id"
    missing = sorted(used - set(headings))
    assert not missing, f"clause ids used but not headings of docs/CONTRACT.md: {missing}"
    assert {cid: c.title for cid, c in CLAUSES.items()} == headings


def test_every_clause_is_asserted_by_some_case() -> None:
    """A clause no case cites is dead text: each one is behind at least one case."""
    used = {ref for spec in _case_specs() for ref in spec.clauses if isinstance(ref, str)}
    assert set(CLAUSES) - used == set()


@pytest.mark.parametrize(("clause", "pattern"), [
    ("C999", "clause 'C999' is not in docs/CONTRACT.md"),
    ("gradient contract", "neither a clause id"),
    (("C1", 2), "clause 2 is neither a clause id"),
])
def test_an_unknown_clause_fails_the_declaration(clause: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        case("area/name", clause=clause)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=pattern):
        CaseSpec(id="area/name", clauses=clause if isinstance(clause, tuple) else (clause,))  # type: ignore[arg-type]


def test_a_case_may_cite_the_implementations_documentation() -> None:
    cited = DocCitation("torch.distributed.fsdp.FullyShardedDataParallel", "sync_module_states")

    @case("area/name", clause=(cited, "C6"))
    def test_x() -> None:
        pass

    spec = next(m.args[0] for m in test_x.pytestmark if m.name == "conformance")  # type: ignore[attr-defined]
    assert spec.clauses == (cited, "C6")
    assert describe(cited) == ("the implementation's documentation: torch.distributed.fsdp.FullyShardedDataParallel, "
                               f"sync_module_states\n  (torch {TORCH_VERSION})")
    with pytest.raises(ValueError, match="needs a document, a section and a torch version"):
        DocCitation("torch.distributed.fsdp.fully_shard", " ")


def test_explain_prints_the_rows_clauses(capsys: pytest.CaptureFixture[str]) -> None:
    """``list --explain`` shows each clause's id, title and torch citation before what the row asserts."""
    row = "placement/cpu_init_with_sync_module_states[on=cpu]"
    assert main(["list", "--explain", row, "-k", "cpu_init_with_sync_module_states"]) == 0
    out = capsys.readouterr().out
    for cid in ("C14", "C6"):
        assert f"clause {cid} {CLAUSES[cid].title} (docs/CONTRACT.md, {cid})" in out, out
        assert f"torch {TORCH_VERSION} documents it in: {CLAUSES[cid].torch_doc}" in out, out
    assert out.index("clause C14") < out.index("A CPU module + sync_module_states"), out
