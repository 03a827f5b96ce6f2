"""What a person sees: a line per case with the total as it finishes, a matrix that fits, reasons for n/a/skip."""

from __future__ import annotations

import pytest

from conformance.contract.results import Result
from conformance.runner.report import render_matrix
from conformance.runner.terminal import render_terminal
from harness.tests.inprocess import pytester_run

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester", "harness.tests.inprocess"]

LONG = ("checkpoint/checkpoint_fsdp_wrapping[nesting=roots,use_orig_params=False,offload_activations=True,"
        "cpu_offload=True]")
IMPLS = ("reference", "torch-fsdp1", "torch-fsdp2", "fairscale-fsdp")


def _results() -> list[Result]:
    out = []
    for case in (LONG, "exec_order/train_eval[strategy=FULL_SHARD]"):
        for impl in IMPLS:
            for mode in ("process", "thread"):
                outcome, reason = {"torch-fsdp2": ("n/a", "torch-fsdp2 lacks capability exec_order_validation"),
                                   "fairscale-fsdp": ("skip", "needs 2 distinct GPUs; found 0")}.get(impl, ("pass", ""))
                out.append(Result(case, impl, mode, 2, outcome, reason, 1.0, {}, "cpu"))
    return out


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_matrix_fits_the_width_and_gives_reasons(width: int) -> None:
    results = _results()
    assert max(len(line) for line in render_matrix(results).splitlines()) > 200, "the wide form would not fit"
    text = render_terminal(results, width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "  6: torch-fsdp2/thread" in text
    assert "  n/a (4): torch-fsdp2 lacks capability" in text
    assert "  skip (4): needs 2 distinct GPUs; found 0" in text
    assert _row_ids(text) == sorted([LONG, "exec_order/train_eval[strategy=FULL_SHARD]"]), "ids wrapped, never cut"


def _row_ids(text: str) -> list[str]:
    """The row ids of a narrow matrix, each put back together from its continuation lines."""
    lines = text.split("\n\n")[0].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("1 "))
    column = lines[header].index("case")
    ids: list[str] = []
    for line in lines[header + 2:]:
        if line[:column].strip():
            ids.append(line[column:])
        else:
            ids[-1] += line[column:]
    return ids


def test_a_matrix_that_fits_keeps_the_named_columns() -> None:
    results = [r for r in _results() if r.impl == "reference" and r.case != LONG]
    assert render_terminal(results, 200) == render_matrix(results)


CASES = '''
import pytest
from conformance.contract.case import case

@case("demo/quick", world_size=1, modes=("thread",))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_quick(ctx, impl, n):
    print("output of the case body")
'''


def test_a_line_per_case_with_the_total(preloaded: None, pytester: pytest.Pytester,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a serial session; under ``-n 2``, test_parallel's transport test checks the same lines and width."""
    pytester.makepyfile(test_demo=CASES)
    monkeypatch.setenv("COLUMNS", "60")
    result = pytester_run(pytester, "--conformance-progress", "-q")
    assert result.ret == 0
    lines = [ln for ln in result.stdout.lines if ln.startswith("[") and "demo/quick" in ln]
    assert len(lines) == 3, result.stdout.str()
    assert sorted(ln.split("]")[0] for ln in lines) == ["[1/3", "[2/3", "[3/3"]
    assert all(" pass  demo/quick[n=" in ln for ln in lines)
    matrix = result.stdout.str().split("conformance matrix")[1].split("conformance: ")[0]
    assert max(len(line) for line in matrix.splitlines()[1:]) <= 60
