"""Comparing a run with a baseline report ([Note: expected outcomes] in conformance.runner.expect): the
comparison itself, its renderings, and whole runs of the suite against a reference and a mutant of it
registered under one name, in-process ([Note: in-process sessions])."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import pytest

from conformance.contract import registry
from conformance.contract.results import Result
from conformance.contract.rows import RENAMED_ROWS
from conformance.runner import cli, findings
from conformance.runner.document import RunFacts, load_baseline, render_json
from conformance.runner.expect import Comparison, compare, normalise, render_text
from conformance.runner.html_report import render_html
from conformance.runner.junit import render_junit
from harness.tests.inprocess import MainResult, pytester_run, run_main

pytest_plugins = ["pytester", "harness.tests.inprocess"]
pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]


def _row(case: str, outcome: str, reason: str = "", mode: str = "thread") -> Result:
    return Result(case=case, impl="x", rank_mode=mode, world_size=2, outcome=outcome, reason=reason, duration_s=0.1)


BASELINE = [
    _row("a/known", "FAIL", "grads differ at 0x7f00aa by 3.5 after 1.25 s"),
    _row("a/fixed", "FAIL", "grads differ"),
    _row("a/steady", "pass", "took 2.0 s"),
    _row("a/breaks", "pass"),
    _row("a/reworded", "FAIL", "expected 3 warnings"),
    _row("a/dropped", "n/a", "needs hybrid"),
    _row("a/gone", "pass"),
]

RUN = [
    _row("a/known", "FAIL", "grads differ at 0x55aa01 by 3.5 after 0.75 s"),
    _row("a/fixed", "pass"),
    _row("a/steady", "pass", "took 3.0 s"),
    _row("a/breaks", "error", "RuntimeError: boom"),
    _row("a/reworded", "FAIL", "expected 4 warnings"),
    _row("a/dropped", "pass"),
    _row("a/added", "pass"),
    _row("a/added_failing", "FAIL", "wrong"),
]


def test_normalise_replaces_only_run_specific_values() -> None:
    assert normalise("at 0x7f3a by pid 412 after 1.5 s (12 ms) on 127.0.0.1:29500") == \
        "at 0x? by pid ? after ? s (? s) on HOST:PORT"
    assert normalise("expected 3 warnings, got 4; max diff 2.5e-03") == "expected 3 warnings, got 4; max diff 2.5e-03"


def test_every_kind_of_difference_is_found_and_only_changes_fail() -> None:
    comparison = compare(BASELINE, RUN, "base.json")
    kinds = {change.cell[0]: change.kind for change in comparison.changes}
    assert kinds == {"a/fixed": "now passes", "a/breaks": "new error", "a/reworded": "changed reason",
                     "a/dropped": "changed outcome", "a/gone": "missing", "a/added": "new cell",
                     "a/added_failing": "new FAIL"}
    assert (comparison.as_expected, comparison.expected_failures) == (2, 1)
    assert comparison.changed
    assert comparison.changes[0].kind == "now passes"  # the most prominent first


def test_only_listed_differences_leave_the_run_unchanged() -> None:
    comparison = compare(BASELINE, [RUN[0], _row("a/added", "n/a", "needs hybrid")], "base.json")
    assert not comparison.changed
    assert {change.kind for change in comparison.changes} == {"missing", "new cell"}
    text = render_text(comparison)
    assert text.startswith("against base.json: as expected; 1 cells as expected (1 of them known FAIL or error)")
    assert "missing (6):" in text and "new cell (1):" in text


def test_the_terminal_text_names_each_changed_cell() -> None:
    text = render_text(compare(BASELINE, RUN, "base.json"))
    assert "CHANGED" in text.splitlines()[0]
    assert "NOW PASSES (1):\n  now passes: a/fixed on x/thread: FAIL (grads differ) -> pass" in text
    assert "changed reason: a/reworded on x/thread: FAIL (expected 3 warnings) -> FAIL (expected 4 warnings)" in text
    assert "make this run's JSON report the new baseline" in text


def _facts(comparison: Comparison | None) -> RunFacts:
    return RunFacts(started_at="2026-01-01T00:00:00+00:00", ended_at="2026-01-01T00:01:00+00:00", settings={},
                    machine={"hostname": "h"}, selected_rows=len(RUN), expectation=comparison)


def test_junit_tells_expected_failures_from_unexpected_ones() -> None:
    suite = ET.fromstring(render_junit(RUN, _facts(compare(BASELINE, RUN, "base.json")))).find("testsuite")
    assert suite is not None
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    known = cases["a/known"].find("skipped")
    assert known is not None and known.get("type") == "expected-failure"
    assert cases["a/known"].find("failure") is None
    fixed = cases["a/fixed"].find("failure")
    assert fixed is not None and fixed.get("type") == "now-passes"
    assert cases["a/reworded"].find("failure") is not None
    props = {p.get("name"): p.get("value") for p in cases["a/reworded"].iter("property")}
    assert props["expectation"] == "changed reason"
    assert (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("3", "1", "1")
    run_props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    assert run_props["expect.changed"] == "true" and run_props["expect.now_passes"] == "1"


def test_html_and_json_show_the_differences_first() -> None:
    comparison = compare(BASELINE, RUN, "base.json")
    page = render_html(RUN, _facts(comparison))
    assert 0 < page.index('id="expectation"') < page.index('id="facts"') < page.index('id="matrix"')
    assert 'data-kind="now passes"' in page and "Changed against the baseline base.json" in page
    document = json.loads(render_json(RUN, _facts(comparison)))
    assert document["expectation"]["changed"] is True
    assert {c["case"]: c["kind"] for c in document["expectation"]["changes"]}["a/fixed"] == "now passes"
    assert json.loads(render_json(RUN, _facts(None)))["expectation"] is None


@pytest.mark.parametrize("text", ["{not json", '{"schema_version": 2, "rows": []}', '{"rows": 3}'])
def test_a_baseline_that_cannot_serve_is_refused_naming_its_path(tmp_path: Path, text: str) -> None:
    path = tmp_path / "base.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"--expect '{path}': "):
        load_baseline(path, "--expect")


def test_a_baseline_written_before_a_rename_compares_cell_by_cell(tmp_path: Path) -> None:
    """[Note: renamed rows]: a baseline's rows under a renamed row's old id (parameters kept) are that row's cells,
    so a nightly baseline written before the rename shows no missing, new or changed cell."""
    old, new = "fuzz/repro_8fc450e8", RENAMED_ROWS["fuzz/repro_8fc450e8"]
    before = [_row(old, "FAIL", "params differ"), _row(f"{old}[n=1]", "pass"), _row("a/steady", "pass")]
    path = tmp_path / "base.json"
    path.write_text(json.dumps({"schema_version": 3, "rows": [asdict(row) for row in before]}))
    run = [_row(new, "FAIL", "params differ"), _row(f"{new}[n=1]", "pass"), _row("a/steady", "pass")]
    comparison = compare(load_baseline(path, "--expect").rows, run, str(path))
    assert comparison.changes == () and not comparison.changed, render_text(comparison)
    assert (comparison.as_expected, comparison.expected_failures) == (3, 1), render_text(comparison)


#: The reference and one mutant of it, registered in turn under the same name: their cells compare.
SUBJECTS = '''
from conformance.adapters.reference import ReferenceAdapter
from conformance.selftest.mutants import ChecksEvalForwards


class Good(ReferenceAdapter):
    name = "subject"


class Broken(ChecksEvalForwards):
    name = "subject"
'''
#: Two cheap rows; the mutant fails the first on thread ranks.
ROWS = "train_eval and FULL_SHARD or invalid_first_iter_order and FULL_SHARD"
CHANGED_CELL = "exec_order/train_eval[strategy=FULL_SHARD] on subject/thread"


@pytest.fixture
def subjects(preloaded: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "expect_subjects.py").write_text(SUBJECTS)
    monkeypatch.delitem(sys.modules, "expect_subjects", raising=False)
    monkeypatch.syspath_prepend(tmp_path)
    return tmp_path


def _run(monkeypatch: pytest.MonkeyPatch, subject: str, *args: str) -> MainResult:
    monkeypatch.setenv(registry.ENV_VAR, f"subject=expect_subjects:{subject}")
    return run_main(cli.main, "run", "--impl", "subject", "--rank-mode", "thread", "-k", ROWS, *args)


def test_a_nightly_fails_only_on_change(subjects: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, broken = subjects / "base.json", subjects / "broken.json"
    first = _run(monkeypatch, "Good", "--json", str(base))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = _run(monkeypatch, "Good", "--expect", str(base))
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"against {base}: as expected; 2 cells as expected" in again.stdout
    mutated = _run(monkeypatch, "Broken", "--expect", str(base), "--json", str(broken))
    assert mutated.returncode == 1, mutated.stdout[-3000:]
    assert f"new FAIL: {CHANGED_CELL}: pass -> FAIL" in mutated.stdout
    assert mutated.stdout.index("changes against the baseline") < mutated.stdout.index("conformance matrix")
    changes = json.loads(broken.read_text())["expectation"]["changes"]
    assert [(c["kind"], c["case"]) for c in changes] == [("new FAIL", "exec_order/train_eval[strategy=FULL_SHARD]")]


def test_a_known_fail_is_expected_and_its_fix_is_reported(subjects: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken, junit = subjects / "broken.json", subjects / "junit.xml"
    first = _run(monkeypatch, "Broken", "--json", str(broken))
    assert first.returncode == 1, first.stdout[-3000:]
    known = _run(monkeypatch, "Broken", "--expect", str(broken), "--junitxml", str(junit))
    assert known.returncode == 0, known.stdout[-3000:]
    assert "(1 of them known FAIL or error)" in known.stdout
    skipped = [case.find("skipped") for case in ET.parse(junit).iter("testcase")]
    assert [s.get("type") for s in skipped if s is not None] == ["expected-failure"]
    fixed = _run(monkeypatch, "Good", "--expect", str(broken))
    assert fixed.returncode == 1, fixed.stdout[-3000:]
    assert f"NOW PASSES (1):\n  now passes: {CHANGED_CELL}: FAIL (" in fixed.stdout


def test_a_documented_choice_is_its_own_outcome_and_fails_no_run(subjects: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A FAIL that a finding of kind ``documented`` explains is the cell "documented" (the implementation does
    what its documentation says): exit 0, JUnit skipped as documented, the citation in the reason; the same
    FAIL with a finding of kind ``bug`` stays FAIL."""
    entry = {"impl": "subject", "rows": CHANGED_CELL.split(" on ")[0], "doc": "d.md"}
    listed, out, junit = subjects / "findings.json", subjects / "out.json", subjects / "junit.xml"
    monkeypatch.setenv(findings.ENV_VAR, str(listed))
    listed.write_text(json.dumps([{**entry, "kind": "documented", "documentation": "subject 1.0, README: eval"}]))
    run = _run(monkeypatch, "Broken", "--json", str(out), "--junitxml", str(junit))
    assert run.returncode == 0, run.stdout[-3000:]
    cells = {(r["case"], r["rank_mode"]): r for r in json.loads(out.read_text())["rows"]}
    cell = cells[(entry["rows"], "thread")]
    assert cell["outcome"] == "documented" and cell["finding"] == "d.md", cell
    assert cell["reason"].startswith("known finding, documented limitation (subject 1.0, README: eval), see d.md: ")
    assert {r["outcome"] for key, r in cells.items() if key != (entry["rows"], "thread")} == {"pass"}
    skipped = [case.find("skipped") for case in ET.parse(junit).iter("testcase")]
    assert [s.get("type") for s in skipped if s is not None] == ["documented"]
    listed.write_text(json.dumps([entry]))
    bug = _run(monkeypatch, "Broken", "--json", str(out))
    assert bug.returncode == 1, bug.stdout[-3000:]
    assert {r["outcome"] for r in json.loads(out.read_text())["rows"]} == {"pass", "FAIL"}


@pytest.mark.parametrize("text", [None, "[{\"case\": 1}]"])
def test_a_bad_baseline_is_a_usage_error_before_any_row(subjects: Path, monkeypatch: pytest.MonkeyPatch,
                                                        text: str | None) -> None:
    base, out = subjects / "base.json", subjects / "out.json"
    if text is not None:
        base.write_text(text)
    run = _run(monkeypatch, "Good", "--expect", str(base), "--json", str(out))
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"--conformance-expect '{base}': not a baseline" in run.stdout + run.stderr
    assert not out.exists() and "conformance matrix" not in run.stdout


#: A row that fails on thread ranks (a known FAIL once in the baseline), one that passes, and a plain test.
DEMO = '''
import pytest
from conformance.contract.case import case

@case("demo/known", world_size=2, modes=("thread",))
def test_known(ctx, impl):
    assert False, "a known failure"

@case("demo/fine", world_size=2, modes=("thread",))
def test_fine(ctx, impl):
    pass

def test_plain():
    assert False, "no conformance row"
'''


@pytest.fixture
def demo(preloaded: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_demo=DEMO)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))  # for the xdist run's subprocess
    monkeypatch.delenv("FSDP_RANK_MODE", raising=False)
    return pytester


def _baseline_with_a_known_fail(demo: pytest.Pytester) -> Path:
    base = demo.path / "base.json"
    first = pytester_run(demo, "-k", "known or fine", "--fsdp-rank-mode", "thread", "--conformance-json", str(base))
    assert first.ret == 1
    assert {r["outcome"] for r in json.loads(base.read_text())["rows"]} == {"FAIL", "pass"}
    return base


def test_a_failed_plain_test_still_fails_a_run_of_expected_cells(demo: pytest.Pytester) -> None:
    base = _baseline_with_a_known_fail(demo)
    plain = pytester_run(demo, "--fsdp-rank-mode", "thread", "--conformance-expect", str(base))
    assert plain.ret == 1, plain.stdout.str()[-3000:]
    assert "as expected; 2 cells as expected" in plain.stdout.str()


@pytest.mark.nightly  # [Note: nightly tests]: the serial runs above take the same expectation path every commit
def test_known_fails_pass_under_workers(demo: pytest.Pytester) -> None:
    base = _baseline_with_a_known_fail(demo)
    parallel = pytester_run(demo, "-k", "known or fine", "--fsdp-rank-mode", "thread", "--conformance-expect",
                            str(base), workers=("-n", "2"))
    assert parallel.ret == 0, parallel.stdout.str()[-3000:]
    assert "as expected; 2 cells as expected (1 of them known FAIL or error)" in parallel.stdout.str()
