"""Hangs cost what the user allows: ``--case-timeout`` per row, ``--max-time`` for the run ([Note: run budget])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.tests.inprocess import pytester_run

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester", "harness.tests.inprocess"]

CASES = '''
import time
import pytest, torch, torch.distributed as dist
from conformance.contract.case import case

@case("demo/hangs", world_size=2, modes=("thread",))
def test_hangs(ctx, impl):
    if ctx.rank != 1:
        dist.all_reduce(torch.ones(1))

@case("demo/slow", world_size=1, modes=("thread",))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_slow(ctx, impl, n):
    time.sleep(6)
'''


@pytest.fixture
def suite(preloaded: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_demo=CASES)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))  # for the xdist run's subprocess
    for name in ("FSDP_RANK_MODE", "FSDP_CONFORMANCE_CASE_TIMEOUT", "FSDP_CONFORMANCE_MAX_TIME"):
        monkeypatch.delenv(name, raising=False)
    return pytester


def _rows(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    return {r["case"]: r for r in (data["rows"] if isinstance(data, dict) else data)}


@pytest.mark.parametrize("source", ["option", "environment"])
def test_case_timeout_bounds_a_hung_row_and_blames_the_rank(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                             source: str) -> None:
    out = suite.path / "r.json"
    if source == "option":
        given = ["--fsdp-case-timeout", "3"]
    else:
        monkeypatch.setenv("FSDP_CONFORMANCE_CASE_TIMEOUT", "3")
        given = []
    result = pytester_run(suite, "-k", "hangs", *given, "--conformance-json", str(out))
    assert result.ret == 1
    row = _rows(out)["demo/hangs"]
    assert row["outcome"] == "FAIL"
    assert row["reason"].startswith("rank 1 did not reach all_reduce #1, which rank 0 waits in"), row["reason"]
    result.stdout.fnmatch_lines(["*rank 0 aborted: waiting in all_reduce #1 for rank 1 (rank 0 timed out: no result "
                                 "after 3 s)*"])
    named = "--fsdp-case-timeout" if given else "FSDP_CONFORMANCE_CASE_TIMEOUT"
    result.stdout.fnmatch_lines([f"*case timeout: 3 (from {named})*"])


def test_bad_case_timeout_is_a_usage_error(suite: pytest.Pytester) -> None:
    result = pytester_run(suite, "--fsdp-case-timeout", "0s")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--fsdp-case-timeout='0s': expected a whole number >= 1*"])


def test_rows_after_the_budget_are_not_run(suite: pytest.Pytester) -> None:
    out = suite.path / "r.json"
    result = pytester_run(suite, "-k", "slow", "--fsdp-max-time", "5", "--conformance-json", str(out),
                          "--conformance-progress")
    rows = _rows(out)
    assert rows["demo/slow[n=1]"]["outcome"] == "pass"
    for late in ("demo/slow[n=2]", "demo/slow[n=3]"):
        assert rows[late]["outcome"] == "not run"
        assert rows[late]["reason"] == "not run: the run's --max-time budget of 5 s was spent"
    assert result.ret == 1, "a run that left rows unrun cannot pass"
    result.stdout.fnmatch_lines(["conformance: 1 pass, 2 not run in *"])


@pytest.mark.nightly  # [Note: nightly tests]: the serial budget tests run every commit
def test_workers_share_the_controllers_deadline(suite: pytest.Pytester) -> None:
    """Workers take longer than a second to start: with a 1 s budget none of them may start a row."""
    out = suite.path / "r.json"
    result = suite.runpytest_subprocess("-k", "slow", "-n", "2", "-p", "conformance.pytest_plugin",
                                        "--fsdp-max-time", "1", "--conformance-json", str(out))
    assert {r["outcome"] for r in _rows(out).values()} == {"not run"}
    assert result.ret == 1
