"""``-n N`` end to end: reports equal a serial run's, timing tests run alone at the end.

Real pytest-xdist sessions in subprocesses. Nothing here asserts a duration:
the timing test checks the order of events (start/end stamps of one clock).
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from conformance.tests.runner.test_plugin_cli import ADAPTERS, CASES

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester"]

STAMPS = '''
import json, os, time
import pytest

def _stamp(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(os.environ["STAMPS"], "a") as f:
        f.write(json.dumps({"test": name, "worker": os.environ["PYTEST_XDIST_WORKER"],
                            "start": start, "end": time.time()}) + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_plain(i):
    _stamp(f"plain{i}", 0.2)

@pytest.mark.timing
@pytest.mark.parametrize("i", range(2))
def test_timed(i):
    _stamp(f"timed{i}", 0.1)

def test_plain_after():
    _stamp("plain_after", 0.2)
'''

LEAVING = '''
import json, os, time

def pytest_sessionfinish(session):
    # workerinput, not PYTEST_XDIST_WORKER: a controller started from an xdist worker inherits that.
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker:
        with open(os.environ["STAMPS"], "a") as f:
            f.write(json.dumps({"left": worker, "at": time.time()}) + "\\n")
'''


def test_timing_tests_run_alone_after_every_other_worker_left(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_stamps=STAMPS)
    pytester.makeconftest(LEAVING)
    stamps = pytester.path / "stamps.jsonl"
    monkeypatch.setenv("STAMPS", str(stamps))
    result = pytester.runpytest_subprocess("-n", "3", "-p", "no:cacheprovider", "-p", "conformance.pytest_plugin")
    result.assert_outcomes(passed=9)
    lines = [json.loads(line) for line in stamps.read_text().splitlines()]
    tests = [r for r in lines if "test" in r]
    timed = sorted((r for r in tests if r["test"].startswith("timed")), key=lambda r: r["start"])
    plain = [r for r in tests if r["test"].startswith("plain")]
    assert len(timed) == 2 and len(plain) == 7
    assert len({r["worker"] for r in timed}) == 1
    alone = timed[0]["worker"]
    assert timed[0]["end"] <= timed[1]["start"]
    assert max(r["end"] for r in plain) <= timed[0]["start"]
    left = {r["left"]: r["at"] for r in lines if "left" in r}
    others = {r["worker"] for r in plain} - {alone}
    assert others and all(left[w] <= timed[0]["start"] for w in others), (left, timed[0])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conformance", *args], capture_output=True, text=True,
                          check=False, timeout=600)


def _reports(directory: Path) -> dict[str, Any]:
    rows = json.loads((directory / "r.json").read_text())["rows"]
    for row in rows:
        row.pop("duration_s")
    testcases = [(c.get("classname"), c.get("name"), [child.tag for child in c])
                 for c in ET.parse(directory / "r.xml").iter("testcase")]
    return {"rows": rows, "junit": testcases, "markdown": (directory / "r.md").read_text()}


def _matrix(stdout: str) -> str:
    return stdout[stdout.index("conformance matrix"):stdout.rindex("conformance: ")]


@pytest.mark.nightly  # [Note: nightly tests]: the transport test below compares serial and -n 2 each commit
def test_cli_parallel_reports_equal_serial(tmp_path: Path) -> None:
    runs = {}
    for workers in ("0", "2"):
        out = tmp_path / workers
        proc = _cli("run", "-n", workers, "-k", "exec_order and not later", "--json", str(out / "r.json"),
                    "--junitxml", str(out / "r.xml"), "--markdown", str(out / "r.md"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"workers: {workers} (from -n)" in proc.stdout
        runs[workers] = (_reports(out), _matrix(proc.stdout))
    serial, parallel = runs["0"], runs["2"]
    assert len(serial[0]["rows"]) == 8
    assert parallel == serial


def test_pytest_parallel_transports_every_outcome(pytester: pytest.Pytester,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """FAIL, n/a, skip and their reasons arrive at the controller as a serial run writes them; so do the run's
    completeness (the controller learns how many rows the workers selected) and its terminal output (a progress
    line per row with the total, the matrix within the terminal's width)."""
    pytester.makepyfile(demo_adapters=ADAPTERS, test_demo=CASES)
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", "bare=demo_adapters:Bare")
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.setenv("COLUMNS", "60")
    rows, runs = {}, {}
    for workers in ("0", "2"):
        out = pytester.path / f"r{workers}.json"
        result = pytester.runpytest_subprocess("-n", workers, "-p", "conformance.pytest_plugin",
                                               "--fsdp-impl", "reference", "--fsdp-impl", "bare",
                                               "-p", "no:cacheprovider", "--conformance-progress",
                                               "--conformance-json", str(out))
        assert result.ret == 1
        result.stdout.fnmatch_lines(["*conformance matrix*", "conformance: *2 FAIL*"])
        doc = json.loads(out.read_text())
        rows[workers] = [{k: v for k, v in r.items() if k != "duration_s"} for r in doc["rows"]]
        runs[workers] = (doc["complete"], doc["selected_rows"])
        total = len(rows[workers])
        progress = [ln[1:].split("]")[0].split("/") for ln in result.stdout.lines
                    if ln.startswith("[") and "demo/" in ln]
        assert sorted((int(done), int(of)) for done, of in progress) == [(i, total) for i in range(1, total + 1)]
        matrix = result.stdout.str().split("conformance matrix")[1].split("conformance: ")[0]
        assert max(len(line) for line in matrix.splitlines()[1:]) <= 60, matrix
    assert {r["outcome"] for r in rows["0"]} == {"pass", "FAIL", "n/a", "skip"}
    assert rows["2"] == rows["0"]
    assert runs["2"] == runs["0"] == (True, len(rows["0"]))


def test_other_distribution_modes_are_a_usage_error(pytester: pytest.Pytester) -> None:
    """--dist loadfile etc. could put a timing test beside others; refused before any worker starts."""
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                                           "-p", "conformance.pytest_plugin")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--dist loadfile: this suite schedules with --dist load*"])
    assert "bringing up nodes" not in result.stdout.str()
