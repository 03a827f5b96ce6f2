"""How a run ends when it is stopped or misdirected: stop signals, bad report paths, a path another run holds."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.runner import exitcodes, signals
from conformance.runner.atomic import ReportLock

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester"]

#: Cases that start ranks in both modes, quick enough that several rows are reported before the signal.
SELECTION = "(training or construction) and not overlap and not device and not gpu"


def _cli(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "conformance", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)  # type: ignore[call-overload]


#: A pytest plugin the stopped runs load: it appends a line to $ROWS_SEEN per row the reporting process has
#: (under -n the controller; a worker's rows reach it through the transport plugin).
ROW_PROBE = """
import os

def pytest_conformance_result(config, result):
    if hasattr(config, "workerinput"):
        return
    with open(os.environ["ROWS_SEEN"], "a") as f:
        f.write(result.case + "\\n")
"""


def _wait_for_rows(proc: subprocess.Popen[str], seen: Path, rows: int, deadline_s: float) -> None:
    """Wait until the run has decided ``rows`` rows."""
    end = time.monotonic() + deadline_s
    while not (seen.exists() and len(seen.read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.monotonic() < end, "the run ended or stalled before the signal"
        time.sleep(0.2)


def _leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(("fsdp-harness-", "pymp-")))


def _group_gone(pgid: int, within_s: float) -> bool:
    """Whether every process of the group has exited (and been reaped) within ``within_s``: a rank or thread
    host whose parent is gone exits within its watchdog's 0.5 s period, then init reaps it."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


# SIGHUP takes the serial path SIGINT takes every commit: it runs nightly ([Note: nightly tests]).
@pytest.mark.parametrize(("stop", "workers"), [(signal.SIGTERM, "2"), (signal.SIGINT, "0"),
                                               pytest.param(signal.SIGHUP, "0", marks=pytest.mark.nightly)])
def test_stop_signal_ends_the_run_with_interrupted_reports(tmp_path: Path, stop: signal.Signals, workers: str,
                                                           request: pytest.FixtureRequest) -> None:
    """The signal goes to the run's whole process group, as CI timeouts and a terminal send it."""
    # The run's temp dir holds the forkserver's socket: a short path, as AF_UNIX allows 107 bytes (a
    # tmp_path under an xdist worker's numbered directories can exceed it).
    tmp, out = Path(tempfile.mkdtemp(prefix="fsdp-stop-")), tmp_path / "reports"
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    (out / "r.json").parent.mkdir()
    (out / "r.json").write_text('["yesterday"]')  # an earlier run's report must not survive
    (tmp_path / "row_probe.py").write_text(ROW_PROBE)
    env = {**os.environ, "TMPDIR": str(tmp), "ROWS_SEEN": str(tmp_path / "seen"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = _cli("-n", workers, "-k", SELECTION, "--json", str(out / "r.json"), "--junitxml", str(out / "r.xml"),
                "--markdown", str(out / "r.md"), "--", "-p", "row_probe", env=env, start_new_session=True)
    try:
        _wait_for_rows(proc, tmp_path / "seen", 2, deadline_s=400)
        os.killpg(proc.pid, stop)
        output, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == exitcodes.INTERRUPTED, output[-3000:]
    assert "conformance matrix" in output and f"stopped by {stop.name}" in output
    doc = json.loads((out / "r.json").read_text())
    assert (doc["complete"], doc["interrupted"], doc["interrupted_by"]) == (False, True, stop.name)
    assert 2 <= doc["summary"]["rows"] == len(doc["rows"])
    assert {r["outcome"] for r in doc["rows"]} <= {"pass", "n/a", "skip"}, doc["rows"]  # no row blamed on the stop
    suite = ET.parse(out / "r.xml").getroot().find("testsuite")
    assert suite is not None
    props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    assert (props["interrupted"], props["interrupted_by"]) == ("true", stop.name)
    assert suite.findall("testcase")[-1].get("name") == "(run interrupted)"
    assert (out / "r.md").read_text().startswith(f"> **Interrupted** ({stop.name})")
    assert _leftovers(tmp) == []
    assert _group_gone(proc.pid, within_s=10.0), "a worker, rank or thread host outlived the run"
    assert sorted(os.listdir(out)) == ["r.json", "r.md", "r.xml"]  # no temporary or lock file left


@pytest.mark.parametrize("case", ["directory", "under_a_file"])
def test_bad_report_path_is_a_usage_error_before_any_case(tmp_path: Path, case: str) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path if case == "directory" else tmp_path / "file" / "r.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = _cli("-k", SELECTION, "--json", str(path))
    output, _ = proc.communicate(timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == exitcodes.USAGE_ERROR, output
    assert f"JSON report {path}: " in output and "Traceback" not in output
    assert "conformance matrix" not in output and "[   1]" not in output
    # Wall time follows the machine's load (on an idle 2-core box: about 3 s); the work done does not.
    assert cpu_s < 5.0, f"{cpu_s:.1f} CPU-s: more than configuring a session"
    assert (path.is_dir() or path.read_text() == "") if case == "directory" else not path.exists()


def test_a_report_path_another_run_holds_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"theirs": true}')
    lock = ReportLock(path, "JSON report")  # this test process stands in for the other run
    try:
        proc = _cli("-k", SELECTION, "--json", str(path))
        output, _ = proc.communicate(timeout=300)
    finally:
        lock.release()
    assert proc.returncode == exitcodes.USAGE_ERROR, output
    assert f"JSON report {path}: another run is writing this report (pid {os.getpid()}" in output
    assert path.read_text() == '{"theirs": true}'


def test_stop_signals_raise_keyboard_interrupt_once() -> None:
    previous = [signal.getsignal(s) for s in signals.STOP_SIGNALS]
    restore = signals.install()
    try:
        assert signals.received() is None
        with pytest.raises(KeyboardInterrupt, match="stopped by SIGHUP"):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)  # the handler raises as soon as the signal arrives
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal while winding down is ignored
        time.sleep(0.1)
        assert signals.received() == "SIGHUP"
    finally:
        restore()
    assert [signal.getsignal(s) for s in signals.STOP_SIGNALS] == previous


def _interrupt_with_a_lineless_frame() -> pytest.ExceptionInfo[KeyboardInterrupt]:
    """A stop signal's interrupt whose traceback holds a frame at an instruction without a line number, as a
    signal landing in an exception-table cleanup leaves it (Python 3.11 and later)."""
    try:
        raise KeyboardInterrupt("stopped by SIGINT")
    except KeyboardInterrupt as exc:
        lineless = types.TracebackType(exc.__traceback__, sys._getframe(), 10**6, -1)
        assert lineless.tb_lineno is None
        return pytest.ExceptionInfo.from_exception(exc.with_traceback(lineless))


def test_an_interrupt_on_a_lineless_instruction_is_still_reported() -> None:
    with pytest.raises(TypeError):  # pytest alone cannot format it: the run would end with code 1, no reports
        _interrupt_with_a_lineless_frame().getrepr(funcargs=True)
    excinfo = _interrupt_with_a_lineless_frame()
    signals.pytest_keyboard_interrupt(excinfo)
    crash = excinfo.getrepr(funcargs=True).reprcrash
    assert crash is not None and "stopped by SIGINT" in crash.message


FULL_DISK = '''
import os

import conformance.runner.atomic as atomic


class _FullDisk:
    """``os`` for the report writer, whose rename fails as on a full disk."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def replace(src, dst):
        raise OSError(28, "No space left on device")


atomic.os = _FullDisk()
'''

ONE_CASE = '''
from conformance.contract.case import case


@case("demo/passes", world_size=1)
def test_passes(ctx, impl):
    pass
'''


def test_a_failed_report_write_keeps_the_old_report(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FULL_DISK)
    pytester.makepyfile(test_demo=ONE_CASE)
    old = pytester.path / "r.json"
    old.write_text('{"schema_version": 2, "rows": []}')
    result = pytester.runpytest_subprocess("-p", "conformance.pytest_plugin", "--fsdp-rank-mode", "thread",
                                           "--conformance-json", str(old),
                                           "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines([f"*could not write the JSON report to {old} (*No space left on device*); "
                                 "the file that was there, if any, is unchanged*"])
    assert old.read_text() == '{"schema_version": 2, "rows": []}'
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith(("r.json", ".r.json"))) == ["r.json"]
    assert exitcodes.from_pytest(int(result.ret), None) == exitcodes.INTERNAL_ERROR


def test_exit_codes_are_documented_in_help_and_usage_guide() -> None:
    proc = subprocess.run([sys.executable, "-m", "conformance", "run", "--help"], capture_output=True, text=True,
                          check=False, timeout=300)
    assert " ".join(exitcodes.HELP.split()) in " ".join(proc.stdout.split())
    readme = (Path(__file__).resolve().parents[3] / "docs" / "USAGE.md").read_text()
    documented = dict(re.findall(r"^\| (\d) \| (\w[^|]*)\|", readme, flags=re.M))
    words = {exitcodes.PASS: "every selected row ran", exitcodes.FAIL: "FAIL", exitcodes.USAGE_ERROR: "usage error",
             exitcodes.INTERNAL_ERROR: "internal error", exitcodes.INTERRUPTED: "interrupted",
             exitcodes.NO_ROWS: "no case matched"}
    assert {int(code) for code in documented} == set(words)
    assert all(words[int(code)] in text for code, text in documented.items()), documented
