"""Matrix and markdown renderings of conformance results (the JSON document: test_report_files.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from expecttest import TestCase

from conformance.contract.results import Result
from conformance.runner.report import render_markdown, render_matrix, summary_line

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

RESULTS = [
    Result("exec_order/train_eval[FULL_SHARD]", "reference", "process", 2, "pass", "", 1.25, placement="cpu"),
    Result("exec_order/train_eval[FULL_SHARD]", "torch-fsdp2", "process", 2, "n/a",
           "torch-fsdp2 lacks capability exec_order_validation", 0.0, placement="cpu"),
    Result("placement/device_id[]", "reference", "process", 1, "skip", "needs any GPU, found 0", 0.0),
    Result("exec_order/invalid_first_iter_order[SHARD_GRAD_OP]", "reference", "process", 2, "FAIL",
           "AssertionError: no matching UserWarning", 2.5, placement="cpu"),
]


class TestRender(TestCase):
    def test_matrix(self) -> None:
        self.assertExpectedInline(
            render_matrix(RESULTS),
            """\
case                                                placement  reference/process  torch-fsdp2/process
--------------------------------------------------  ---------  -----------------  -------------------
exec_order/invalid_first_iter_order[SHARD_GRAD_OP]  cpu        FAIL
exec_order/train_eval[FULL_SHARD]                   cpu        pass               n/a
placement/device_id[]                               -          skip""",
        )

    def test_summary_counts_every_outcome(self) -> None:
        self.assertExpectedInline(
            summary_line(RESULTS),
            """conformance: 1 pass, 1 FAIL, 1 n/a, 1 skip in 3.8 s of case time""",
        )

    def test_markdown_lists_reasons_of_non_passing_cells(self) -> None:
        text = render_markdown(RESULTS)
        assert "| `exec_order/train_eval[FULL_SHARD]` | cpu | pass | n/a |" in text
        assert "**n/a** — torch-fsdp2 lacks capability exec_order_validation" in text
        assert "**FAIL** — AssertionError: no matching UserWarning" in text


def test_matrix_shows_each_rows_placement() -> None:
    shared = [Result("placement/device_id[]", impl, mode, 2, "pass", "", 0.5, placement="cuda-shared")
              for impl in ("reference", "torch-fsdp2") for mode in ("process", "thread")]
    lines = render_matrix([*shared, RESULTS[2]]).splitlines()
    assert lines[0].split()[:2] == ["case", "placement"]
    assert lines[2].split()[:2] == ["placement/device_id[]", "cuda-shared"]


def test_unknown_outcome_is_rejected() -> None:
    with pytest.raises(ValueError, match="outcome 'passed' not in"):
        Result("a/b", "reference", "process", 2, "passed", "", 0.0)


def test_empty_matrix() -> None:
    assert render_matrix([]) == "(no conformance results)"


def test_summary_counts_outcomes_per_area_and_lists_failures() -> None:
    from conformance.runner.summarize import summarize

    text = summarize(RESULTS)
    assert "| exec_order | 1 pass, 1 FAIL | 1 n/a |" in text
    assert "| placement | 1 skip | - |" in text
    assert "- `exec_order/invalid_first_iter_order` on reference: AssertionError: no matching UserWarning" in text


def test_summary_totals_each_implementation_with_its_na_share() -> None:
    from conformance.runner.summarize import summarize

    last_row = [line for line in summarize(RESULTS).splitlines() if line.startswith("| **all** |")]
    assert last_row, "no totals row"
    reference, torch_fsdp2 = last_row[0].split(" | ")[1:3]
    assert "1 n/a" not in reference and "% n/a" in reference
    assert torch_fsdp2.startswith("1 n/a") and "(100.0 % n/a)" in torch_fsdp2


def test_summarize_names_an_unreadable_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conformance.runner.summarize import main

    missing = tmp_path / "nope.json"
    with pytest.raises(SystemExit) as exc:
        main([str(missing)])
    assert exc.value.code == 2
    assert "nope.json: not a readable JSON report" in capsys.readouterr().err
