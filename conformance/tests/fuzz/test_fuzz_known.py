"""The stateful search goes past the registered findings it meets ([Note: known findings in a search]).

A test adapter over the reference plants failures: a ``load_state_dict`` that raises (registered as a known
finding that sets ``Load`` aside) and a ``no_sync`` that raises (registered nowhere). At world size 1 the search
meets the load at its third program and again at its sixth and tenth at seed 19 (:data:`LOAD_SEED`), and at seed 2
(:data:`NO_SYNC_SEED`) the load at its third and then the ``no_sync`` (with ``Load`` set aside).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.nn as nn

from conformance.adapters.reference import ReferenceAdapter
from conformance.contract.case import CaseSettings, KnownFailure
from conformance.fuzz.driver import Search
from conformance.fuzz.example import source
from conformance.fuzz.ops import Load, NoSync
from conformance.fuzz.searching import SET_ASIDE, KnownFindings, failure_text, stateful_fuzz
from conformance.runner.findings import BUILTIN_FILE, Finding, load_file
from harness import RankContext, run

LOAD_DOC = "docs/findings/planted-load.md"


class PlantedLoad(ReferenceAdapter):
    """The reference, whose ``load_state_dict`` raises."""

    name = "planted-load"

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        raise RuntimeError("planted: load")


class PlantedLoadAndNoSync(PlantedLoad):
    """... and whose ``no_sync`` raises too."""

    name = "planted-load-and-no-sync"

    def no_sync(self, model: nn.Module) -> Any:
        raise RuntimeError("planted: no_sync")


#: The seeds whose draws the tests below rely on: the planted load met twice without setting ``Load`` aside (and
#: once with it), and met before the planted ``no_sync`` fails.
LOAD_SEED, NO_SYNC_SEED = 19, 2


def _settings(set_aside: tuple[str, ...], *, shrink: bool = False, seed: int = NO_SYNC_SEED) -> CaseSettings:
    known = KnownFailure(LOAD_DOC, r"op \d+ \(Load\(\)\), rank 0: raised: RuntimeError: planted: load", set_aside)
    return CaseSettings(fuzz_stateful_examples=10, fuzz_seed=seed, fuzz_shrink=shrink, known_failures=(known,))


def _fuzz(ctx: RankContext, impl: Any, settings: CaseSettings) -> Search:
    return stateful_fuzz(ctx, impl, settings)


def _search(impl: Any, settings: CaseSettings) -> Search:
    result: Search = run(_fuzz, world_size=1, mode="thread", timeout_s=240, args=(impl, settings))[0]
    return result


def test_a_known_finding_is_recorded_and_the_search_goes_on_without_its_trigger() -> None:
    """The row's whole budget is drawn; the known failure is recorded with its program and operation and is no
    failure of the row's; once ``Load`` is set aside no later program meets it, where without it one does."""
    aside = _search(PlantedLoad(), _settings(("Load",), seed=LOAD_SEED))
    assert aside.failing is None and aside.runs == 10, aside
    assert [(m.run, m.doc) for m in aside.met] == [(3, LOAD_DOC)], aside.met
    assert any(isinstance(op, Load) for op in aside.met[0].value.ops), source(aside.met[0].value)
    assert "(Load()), rank 0: raised: RuntimeError: planted: load" in aside.met[0].failure
    again = _search(PlantedLoad(), _settings((), seed=LOAD_SEED))
    assert again.failing is None and [m.run for m in again.met] == [3, 6, 10], again.met
    text = failure_text(_settings(("Load",), seed=LOAD_SEED), aside)
    assert text is not None, "a row that met only known findings still FAILs"
    first, *rest = text.splitlines()
    assert first.startswith(f"stateful fuzzer (seed {LOAD_SEED}") and first.endswith("planted: load"), first
    assert rest[0] == "only known findings met, in 1 of 10 programs:", rest
    assert rest[1].startswith(f"program 3: {LOAD_DOC} claims op "), rest


def test_an_unknown_failure_after_a_known_one_is_the_rows_failure_shrunk() -> None:
    """After the known finding the search meets the unregistered ``no_sync`` failure: the row FAILs with it,
    shrunk to a program whose ``NoSync`` fails and which no finding claims, and lists the known finding met."""
    result = _search(PlantedLoadAndNoSync(), _settings(("Load",), shrink=True))
    assert [m.run for m in result.met] == [3], result.met
    assert result.failing is not None and result.message is not None and not result.cut, result
    assert "raised: RuntimeError: planted: no_sync" in result.message, result.message
    assert any(isinstance(op, NoSync) for op in result.failing.ops), source(result.failing)
    assert not any(isinstance(op, Load) for op in result.failing.ops), source(result.failing)
    text = failure_text(_settings(("Load",), shrink=True), result)
    assert text is not None and "planted: no_sync" in text.splitlines()[0], text
    assert "minimal reproducer after" in text and f"known finding met before it, program 3: {LOAD_DOC}" in text


def test_a_finding_setting_aside_what_the_fuzzer_does_not_draw_is_refused() -> None:
    with pytest.raises(ValueError, match=r"docs/x\.md sets aside \['Lode'\], which the stateful fuzzer does not"):
        KnownFindings((KnownFailure("docs/x.md", None, ("Lode", "Load")),), seed=0)


def test_the_built_in_findings_set_aside_what_the_fuzzer_draws() -> None:
    for finding in load_file(BUILTIN_FILE):
        assert set(finding.set_aside) <= SET_ASIDE, finding
    assert any(finding.set_aside for finding in load_file(BUILTIN_FILE))


@pytest.mark.parametrize(("set_aside", "message"), [
    ("Load", "'set_aside' must be a list of non-empty names, got 'Load'"),
    ([""], r"'set_aside' must be a list of non-empty names, got \[''\]"),
])
def test_a_registration_with_a_malformed_set_aside_names_it(tmp_path: Path, set_aside: Any, message: str) -> None:
    listed = tmp_path / "findings.json"
    listed.write_text(json.dumps([{"impl": "x", "rows": "fuzz/*", "doc": "d.md", "set_aside": set_aside}]))
    with pytest.raises(ValueError, match=message):
        load_file(listed)


def test_a_registration_passes_what_it_sets_aside_to_the_row(tmp_path: Path) -> None:
    listed = tmp_path / "findings.json"
    listed.write_text(json.dumps([{"impl": "x", "rows": "fuzz/*", "doc": "d.md", "reason": "r", "set_aside": ["Load"]},
                                  {"impl": "x", "rows": "fuzz/*", "doc": "e.md"}]))
    assert [f.known_failure() for f in load_file(listed)] == [KnownFailure("d.md", "r", ("Load",)),
                                                               KnownFailure("e.md", None, ())]
    assert Finding("x", "fuzz/*", "e.md").set_aside == ()


def _fuzz_within(ctx: RankContext, impl: Any, settings: CaseSettings, shrink_s: float) -> Search:
    """:func:`_fuzz` with the search's shrinking budget set to ``shrink_s`` for this call only."""
    from conformance.fuzz import searching

    kept = searching.SEARCH_S
    searching.SEARCH_S = shrink_s
    try:
        return stateful_fuzz(ctx, impl, settings)
    finally:
        searching.SEARCH_S = kept


def test_a_spent_shrinking_budget_reports_the_failure_so_far_and_says_so() -> None:
    """[Note: shrinking within a budget]: with no time left to shrink, the row FAILs with the first failure no
    finding claims, as drawn, and its text says it was not shrunk to a minimum (the test above, with the row's
    own budget, shrinks to the end: its negative control)."""
    settings = _settings(("Load",), shrink=True)
    result: Search = run(_fuzz_within, world_size=1, mode="thread", timeout_s=240,
                         args=(PlantedLoadAndNoSync(), settings, 0.0))[0]
    assert result.cut and result.failing is not None and result.message is not None, result
    assert "raised: RuntimeError: planted: no_sync" in result.message, result.message
    text = failure_text(settings, result)
    assert text is not None and "(the search's budget) but not to a minimum, after" in text, text
    assert "minimal reproducer after" not in text, text
