"""Selecting rows by id ([Note: row selection] in conformance.runner.selection), in nested in-process sessions
([Note: in-process sessions]); with xdist workers, in pytest subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.contract.rows import RENAMED_ROWS
from harness.tests.inprocess import pytester_run

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester", "harness.tests.inprocess"]

CASES = '''
import pytest
from conformance.contract.case import case

@case("demo/mixed", world_size=2)
@pytest.mark.parametrize("n", [1, 2])
def test_mixed(ctx, impl, n):
    assert not (n == 2 and ctx.mode == "thread"), "n=2 fails on thread ranks"

@case("demo/fine", world_size=2, modes=("thread",))
def test_fine(ctx, impl):
    pass
'''


@pytest.fixture
def suite(preloaded: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_demo=CASES)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))  # for the xdist runs' subprocesses
    monkeypatch.delenv("FSDP_RANK_MODE", raising=False)
    return pytester


def _cells(path: Path) -> dict[tuple[str, str, str], str]:
    data = json.loads(path.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    return {(r["case"], r["impl"], r["rank_mode"]): r["outcome"] for r in rows}


def test_rows_from_reruns_exactly_the_failed_cells(suite: pytest.Pytester) -> None:
    first, again = suite.path / "first.json", suite.path / "again.json"
    ran = pytester_run(suite, "--conformance-json", str(first), "--fsdp-rank-mode", "both")
    assert ran.ret == 1
    failed = {cell for cell, outcome in _cells(first).items() if outcome == "FAIL"}
    assert failed == {("demo/mixed[n=2]", "reference", "thread")}
    assert len(_cells(first)) == 5
    rerun = pytester_run(suite, "--fsdp-rows-from", str(first), "--conformance-json", str(again))
    assert rerun.ret == 1
    assert _cells(again) == {("demo/mixed[n=2]", "reference", "thread"): "FAIL"}
    passed = suite.path / "passed.json"
    pytester_run(suite, "--fsdp-rows-from", str(first), "--fsdp-rows-outcome", "pass,n/a",
                 "--conformance-json", str(passed))
    assert set(_cells(passed)) == {cell for cell, outcome in _cells(first).items() if outcome in ("pass", "n/a")}
    assert len(_cells(passed)) == 4


def test_rows_from_reads_an_object_with_rows(suite: pytest.Pytester) -> None:
    report = suite.path / "object.json"
    row = {"case": "demo/mixed[n=1]", "impl": "reference", "rank_mode": "thread", "outcome": "error"}
    report.write_text(json.dumps({"schema_version": 2, "rows": [row]}))
    out = suite.path / "out.json"
    result = pytester_run(suite, "--fsdp-rows-from", str(report), "--conformance-json", str(out))
    assert result.ret == 0
    assert _cells(out) == {("demo/mixed[n=1]", "reference", "thread"): "pass"}


def test_row_runs_every_cell_of_the_row(suite: pytest.Pytester) -> None:
    out = suite.path / "out.json"
    result = pytester_run(suite, "--fsdp-row", "demo/mixed[n=1]", "--fsdp-row", "demo/fine",
                          "--fsdp-rank-mode", "thread",
                          "--conformance-json", str(out))
    assert result.ret == 0
    assert set(_cells(out)) == {("demo/mixed[n=1]", "reference", "thread"), ("demo/fine", "reference", "thread")}


# The xdist variant runs nightly; the serial one every commit ([Note: nightly tests]).
@pytest.mark.parametrize("workers", [[], pytest.param(["-n", "2"], marks=pytest.mark.nightly)], ids=["serial", "xdist"])
def test_unknown_row_is_a_usage_error_naming_it(suite: pytest.Pytester, workers: list[str]) -> None:
    result = pytester_run(suite, "--fsdp-row", "demo/mixed[n=3]", workers=workers)
    assert result.ret == 4
    assert "--fsdp-row: unknown row id(s) 'demo/mixed[n=3]'" in result.stderr.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_report_problems_are_usage_errors_naming_the_report(suite: pytest.Pytester) -> None:
    report = suite.path / "r.json"
    report.write_text(json.dumps([{"case": "demo/fine", "impl": "torch-fsdp2", "rank_mode": "thread",
                                   "outcome": "FAIL"}]))
    result = pytester_run(suite, "--fsdp-rows-from", str(report))
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--fsdp-rows-from *r.json: 1 cell(s) in column(s) torch-fsdp2/thread that this run "
                                 "does not select*--fsdp-impl*"])
    report.write_text("[{")
    broken = pytester_run(suite, "--fsdp-rows-from", str(report))
    assert broken.ret == 4
    broken.stderr.fnmatch_lines(["*--fsdp-rows-from *r.json*: cannot read a JSON report*"])
    bad_outcome = pytester_run(suite, "--fsdp-rows-from", str(report), "--fsdp-rows-outcome", "FAIL,failed")
    assert bad_outcome.ret == 4
    bad_outcome.stderr.fnmatch_lines(["*--fsdp-rows-outcome='FAIL,failed'*['failed']*"])


def test_report_without_such_rows_has_nothing_to_rerun(suite: pytest.Pytester) -> None:
    report = suite.path / "r.json"
    report.write_text(json.dumps([{"case": "demo/fine", "impl": "reference", "rank_mode": "thread",
                                   "outcome": "pass"}]))
    result = pytester_run(suite, "--fsdp-rows-from", str(report))
    assert result.ret == 0
    result.stderr.fnmatch_lines(["*has no FAIL/error rows; nothing to re-run*"])


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_malformed_keyword_is_a_usage_error(suite: pytest.Pytester, workers: list[str]) -> None:
    result = pytester_run(suite, "-k", "mixed and", workers=workers)
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*-k 'mixed and' is not a valid selection expression*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_a_renamed_rows_old_id_selects_it_with_a_warning(suite: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: renamed rows]: ``--fsdp-row OLD`` runs the renamed row's cells, with a terminal line and a
    DeprecationWarning naming the new id; a report's rows under the old id re-run the renamed row's cells."""
    monkeypatch.setitem(RENAMED_ROWS, "demo/old_mixed", "demo/mixed")
    out, again = suite.path / "out.json", suite.path / "again.json"
    result = pytester_run(suite, "--fsdp-row", "demo/old_mixed[n=2]", "--fsdp-rank-mode", "both",
                          "--conformance-json", str(out))
    assert result.ret == 1
    assert _cells(out) == {("demo/mixed[n=2]", "reference", "thread"): "FAIL",
                           ("demo/mixed[n=2]", "reference", "process"): "pass"}
    said = "--row: row id 'demo/old_mixed[n=2]' is renamed 'demo/mixed[n=2]'"
    lines = result.stdout.lines
    assert any(line.startswith(f"fsdp-conformance: {said}; ") for line in lines), lines
    assert any(f"DeprecationWarning: {said}; " in line for line in lines), lines
    report = suite.path / "old.json"
    report.write_text(json.dumps([{**row, "case": row["case"].replace("demo/mixed", "demo/old_mixed")}
                                  for row in json.loads(out.read_text())["rows"]]))
    rerun = pytester_run(suite, "--fsdp-rows-from", str(report), "--conformance-json", str(again))
    assert rerun.ret == 1
    assert _cells(again) == {("demo/mixed[n=2]", "reference", "thread"): "FAIL"}
    assert "is renamed" not in rerun.stdout.str()
