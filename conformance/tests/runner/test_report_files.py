"""The report files: the versioned JSON document, JUnit, atomic writes, path checks and the per-path lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import pytest

from conformance.contract.results import Result
from conformance.runner import atomic
from conformance.runner.atomic import ReportLock, check_path, write_atomic
from conformance.runner.document import SCHEMA_VERSION, RunFacts, load_report, render_json
from conformance.runner.junit import render_junit

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

RESULTS = [
    Result("exec_order/train_eval[FULL_SHARD]", "reference", "process", 2, "pass", "", 1.25, placement="cpu"),
    Result("exec_order/train_eval[FULL_SHARD]", "torch-fsdp2", "process", 2, "n/a",
           "torch-fsdp2 lacks capability exec_order_validation", 0.0, placement="cpu"),
    Result("misc/device_id[]", "reference", "process", 1, "skip", "needs any GPU, found 0", 0.0),
    Result("misc/cpu_offload[]", "torch-fsdp1", "thread", 2, "FAIL",
           "known finding, see docs/findings/fsdp1-cpu-offload-pinning.md: rank 0 raised RuntimeError: x", 2.5,
           placement="cpu", finding="docs/findings/fsdp1-cpu-offload-pinning.md"),
    Result("misc/boom[]", "reference", "thread", 2, "error", "adapter 'x' failed to load", 0.0),
]
SETTINGS = {"impls": {"value": ["reference"], "source": "default"}, "device": {"value": "cpu", "source": "--device"}}


def _facts(interrupted_by: str | None = None) -> RunFacts:
    return RunFacts(started_at="2026-01-01T00:00:00+00:00", ended_at="2026-01-01T00:01:00+00:00",
                    settings=SETTINGS, machine={"hostname": "box", "gpus_visible": 0}, interrupted_by=interrupted_by,
                    torch="2.13.0", python="3.11.7", selected_rows=len(RESULTS), tool_version="0.1.0")


def test_json_document_carries_the_run_and_its_rows() -> None:
    doc = json.loads(render_json(RESULTS, _facts()))
    assert doc["schema_version"] == SCHEMA_VERSION == 3
    assert (doc["torch"], doc["python"], doc["machine"]["hostname"]) == ("2.13.0", "3.11.7", "box")
    assert doc["settings"]["device"] == {"value": "cpu", "source": "--device"}
    assert (doc["started_at"], doc["ended_at"]) == ("2026-01-01T00:00:00+00:00", "2026-01-01T00:01:00+00:00")
    assert (doc["complete"], doc["interrupted"], doc["interrupted_by"]) == (True, False, None)
    assert doc["summary"] == {"rows": 5, "pass": 1, "FAIL": 1, "documented": 0, "error": 1, "n/a": 1, "skip": 1,
                              "not run": 0, "case_time_s": 3.75}
    assert doc["outcomes"] == ["pass", "FAIL", "documented", "error", "n/a", "skip", "not run"]
    assert doc["placements"] == ["cpu"]
    assert doc["rows"] == [asdict(r) for r in RESULTS]
    assert doc["rows"][3]["finding"] == "docs/findings/fsdp1-cpu-offload-pinning.md"


def test_interrupted_document_says_so() -> None:
    doc = json.loads(render_json(RESULTS[:2], _facts("SIGTERM")))
    assert (doc["complete"], doc["interrupted"], doc["interrupted_by"]) == (False, True, "SIGTERM")
    assert doc["summary"]["rows"] == 2


def test_a_report_missing_rows_is_never_complete() -> None:
    """Rows missing without a stop signal, or a row count the run never learnt: not complete, in every format."""
    from conformance.runner.html_report import render_html

    doc = json.loads(render_json(RESULTS[:3], _facts()))
    assert (doc["complete"], doc["interrupted"], doc["selected_rows"]) == (False, False, 5)
    assert doc["incomplete_reason"].startswith("2 of 5 selected rows have no outcome")
    unknown = RunFacts(started_at="", ended_at="", settings={}, machine={}, torch="2.13.0", python="3.11.7")
    assert json.loads(render_json(RESULTS, unknown))["complete"] is False
    suite = ET.fromstring(render_junit(RESULTS[:3], _facts())).find("testsuite")
    assert suite is not None
    props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    assert (props["complete"], props["interrupted"], props["tool_version"]) == ("false", "false", "0.1.0")
    last = suite.findall("testcase")[-1]
    assert last.get("name") == "(run incomplete)" and last.find("error") is not None
    assert (suite.get("tests"), suite.get("errors")) == ("4", "1")  # 3 rows, none an error, and the missing ones
    assert "Incomplete: 2 of 5 selected rows have no outcome" in render_html(RESULTS[:3], _facts(), Path("."))
    assert "Complete: every selected row ran" in render_html(RESULTS, _facts(), Path("."))


def test_json_document_names_the_suite_and_adapter_versions() -> None:
    adapters = [{"name": "reference", "target": "conformance.adapters.reference:ReferenceAdapter",
                 "distribution": "fsdp-conformance", "version": "0.1.0"}]
    facts = RunFacts(started_at="", ended_at="", settings={}, machine={}, torch="2.13.0", python="3.11.7",
                     tool_version="0.1.0", adapters=adapters)
    doc = json.loads(render_json(RESULTS, facts))
    assert (doc["tool"], doc["tool_version"], doc["adapters"]) == ("fsdp-conformance", "0.1.0", adapters)


def test_load_report_reads_every_schema(tmp_path: Path) -> None:
    current, older, legacy = tmp_path / "v3.json", tmp_path / "v2.json", tmp_path / "v1.json"
    current.write_text(render_json(RESULTS, _facts("SIGINT")))
    older.write_text(json.dumps({**json.loads(current.read_text()), "schema_version": 2}))
    legacy.write_text(json.dumps([{k: v for k, v in asdict(r).items() if k != "finding"} for r in RESULTS]))
    v2, v1 = load_report(current), load_report(legacy)
    assert (v2.schema_version, load_report(older).schema_version, v1.schema_version) == (3, 2, 1)
    assert v2.rows == RESULTS == load_report(older).rows
    assert [r.case for r in v1.rows] == [r.case for r in RESULTS] and v1.rows[3].finding == ""
    assert (v2.complete, v1.complete) == (False, True)
    assert v2.header["torch"] == "2.13.0" and "rows" not in v2.header


@pytest.mark.parametrize(("text", "message"), [
    ('{"schema_version": 99, "rows": []}', "schema_version 99 is newer than this reader's 3"),
    ('{"rows": []}', "expected a report object with schema_version"),
    ('{"schema_version": 2, "rows": [{"case": "a/b", "outcome": "passed"}]}', "a row is malformed"),
    ("[1, 2", "not a readable JSON report"),
])
def test_load_report_names_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{path}: .*{message}"):
        load_report(path)


def test_junit_names_rows_and_tells_na_from_hardware_skip() -> None:
    root = ET.fromstring(render_junit(RESULTS, _facts()))
    suite = root.find("testsuite")
    assert suite is not None
    counts = (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped"))
    assert counts == ("5", "1", "1", "2")
    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [(f"{r.impl}.{r.rank_mode}", r.case)
                                                                     for r in RESULTS]
    skipped = [c.find("skipped") for c in cases[1:3]]
    assert [s.get("type") if s is not None else None for s in skipped] == ["not-applicable", "hardware"]
    failure = cases[3].find("failure")
    assert failure is not None and failure.get("type") == "known-finding"
    assert cases[3].find("properties/property[@name='finding']").get("value") == (  # type: ignore[union-attr]
        "docs/findings/fsdp1-cpu-offload-pinning.md")
    assert cases[4].find("error") is not None
    props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    assert (props["complete"], props["interrupted"]) == ("true", "false")
    assert props["setting.device"] == "cpu (from --device)"


def test_junit_marks_an_interrupted_run() -> None:
    root = ET.fromstring(render_junit(RESULTS[:1], _facts("SIGHUP")))
    suite = root.find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("errors")) == ("2", "1")
    props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    assert (props["complete"], props["interrupted"], props["interrupted_by"]) == ("false", "true", "SIGHUP")
    marker = suite.findall("testcase")[-1]
    error = marker.find("error")
    assert marker.get("name") == "(run interrupted)" and error is not None and error.get("type") == "interrupted"
    assert "stopped by SIGHUP after 1 rows" in (error.get("message") or "")


def test_write_atomic_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_failed_write_keeps_the_old_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails part-way (a full disk, injected) leaves the old file whole and no temporary file."""
    path = tmp_path / "r.json"
    path.write_text('{"old": true}')
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.file = real_fdopen(*args, **kwargs)  # type: ignore[call-overload]

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, text: str) -> int:
            self.file.write(text[: len(text) // 2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fdopen", FullDisk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, '{"new": true, "longer": "x"}')
    assert path.read_text() == '{"old": true}' and os.listdir(tmp_path) == ["r.json"]


def test_failed_write_without_atomic_rename_would_truncate(tmp_path: Path) -> None:
    """Negative control for the test above: writing in place, as reports were written before, loses the old file."""
    path = tmp_path / "r.json"
    path.write_text('{"old": true}')
    with open(path, "w") as f:  # what Path.write_text does
        f.write('{"new"')  # the disk fills here
    assert path.read_text() != '{"old": true}'


@pytest.mark.parametrize("case", ["directory", "under_a_file", "read_only_dir"])
def test_check_path_refuses_unwritable_paths(tmp_path: Path, case: str) -> None:
    if case == "directory":
        path, message = tmp_path, "is a directory"
    elif case == "under_a_file":
        (tmp_path / "file").write_text("")
        path, message = tmp_path / "file" / "sub" / "r.json", "file is a file, not a directory"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes to read-only directories")
        (tmp_path / "ro").mkdir(mode=0o500)
        path, message = tmp_path / "ro" / "r.json", "is not writable"
    with pytest.raises(ValueError, match=f"JSON report {path}: .*{message}"):
        check_path(path, "JSON report")


def test_check_path_creates_the_directory(tmp_path: Path) -> None:
    check_path(tmp_path / "a" / "b" / "r.json", "JSON report")
    assert (tmp_path / "a" / "b").is_dir()


def test_second_lock_on_a_path_is_refused_and_freed_when_the_holder_dies(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from conformance.runner.atomic import ReportLock; "
                               f"ReportLock(Path({str(path)!r}), 'JSON report'); print('locked', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=f"JSON report {path}: another run is writing this report "
                                             f"\\(pid {holder.pid}"):
            ReportLock(path, "JSON report")
    finally:
        holder.kill()
        holder.wait()
    lock = ReportLock(path, "JSON report")  # the kernel dropped the dead holder's lock
    lock.release()
    lock.release()
    assert not (tmp_path / "r.json.lock").exists()
