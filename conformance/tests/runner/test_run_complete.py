"""A report says ``complete`` only when every selected row is in it, and records the software that ran.

Nested sessions ([Note: in-process sessions]) over three one-rank cases; under ``-n`` a subprocess.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from conformance.runner.versions import suite_version
from harness.tests.inprocess import pytester_run

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester", "harness.tests.inprocess"]

CASES = '''
from conformance.contract.case import case

@case("demo/first", world_size=1, modes=("thread",))
def test_first(ctx, impl):
    pass

@case("demo/fails", world_size=1, modes=("thread",))
def test_fails(ctx, impl):
    raise AssertionError("fails on purpose")

@case("demo/last", world_size=1, modes=("thread",))
def test_last(ctx, impl):
    pass
'''

ADAPTERS = '''
from conformance.adapters.reference import ReferenceAdapter

class Dev(ReferenceAdapter):
    """An adapter being written: registered from a source tree, no distribution package."""
    name = "dev"
'''

#: A plugin whose result hook raises for one row, as a findings lookup that failed at teardown did: the row
#: ends without reaching the matrix.
LOSES_A_ROW = '''
def pytest_conformance_result(config, result):
    if result.case == "demo/last":
        raise RuntimeError("lost on its way to the matrix")
'''


@pytest.fixture
def suite(preloaded: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_demo=CASES, demo_adapters=ADAPTERS)
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", "dev=demo_adapters:Dev")
    return pytester


def _report(suite: pytest.Pytester, *args: str, workers: tuple[str, ...] = ()) -> dict[str, Any]:
    out = suite.path / "r.json"
    result = pytester_run(suite, "--fsdp-rank-mode", "thread", "--conformance-json", str(out), "-p", "no:cacheprovider",
                          *args, workers=workers)
    assert result.ret == 1, result.stdout.str()[-3000:]  # demo/fails, when it runs
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_a_run_that_ends_with_every_row_is_complete_and_names_its_software(suite: pytest.Pytester) -> None:
    doc = _report(suite, "--fsdp-impl", "reference", "--fsdp-impl", "dev")
    assert (doc["complete"], doc["incomplete_reason"], doc["selected_rows"]) == (True, None, 6)
    assert doc["summary"]["rows"] == 6 and doc["tool_version"] == suite_version() != "unknown"
    assert doc["adapters"] == [
        {"name": "reference", "target": "conformance.adapters.reference:ReferenceAdapter",
         "distribution": "fsdp-conformance", "version": suite_version()},
        {"name": "dev", "target": "demo_adapters:Dev", "distribution": None, "version": None},
    ]
    assert doc["settings"]["extra_adapters"] == {"value": ["dev=demo_adapters:Dev"],
                                                 "source": "FSDP_CONFORMANCE_ADAPTERS"}


def test_a_run_stopped_by_its_first_failure_is_not_complete(suite: pytest.Pytester) -> None:
    markdown = suite.path / "r.md"
    doc = _report(suite, "-x", "--conformance-markdown", str(markdown))
    assert markdown.read_text().startswith("> **Incomplete**: 1 of 3 selected rows have no outcome")
    assert [row["case"] for row in doc["rows"]] == ["demo/first", "demo/fails"]
    assert (doc["complete"], doc["selected_rows"], doc["interrupted"]) == (False, 3, False)
    assert doc["incomplete_reason"].startswith("1 of 3 selected rows have no outcome")


def test_a_row_that_never_reaches_the_matrix_makes_the_run_incomplete(suite: pytest.Pytester) -> None:
    suite.makeconftest(LOSES_A_ROW)
    doc = _report(suite)
    assert [row["case"] for row in doc["rows"]] == ["demo/first", "demo/fails"]
    assert (doc["complete"], doc["selected_rows"]) == (False, 3)


@pytest.mark.nightly  # [Note: nightly tests]: the serial lost-row test above runs every commit
def test_under_workers_the_controller_learns_how_many_rows_were_selected(suite: pytest.Pytester) -> None:
    """A row lost on a worker leaves the run incomplete: the controller counts what the workers selected (a
    complete run under ``-n 2`` is test_parallel's transport test)."""
    lost = suite.path / "conftest.py"
    lost.write_text(LOSES_A_ROW)
    doc = _report(suite, workers=("-n", "2"))
    assert (doc["complete"], doc["selected_rows"], doc["summary"]["rows"]) == (False, 3, 2)
