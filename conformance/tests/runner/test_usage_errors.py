"""Every setting and input is checked before the first row: a bad one is a usage error (exit code 2) naming it.

Each bad input runs ``fsdp-conformance run`` (its ``main``, in this process: [Note: in-process sessions])
with a JSON report asked for, and requires exit code 2, the variable or path and its value in the message,
and no row: no progress line, no matrix, no report written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conformance.runner import cli, exitcodes
from harness.tests.inprocess import MainResult, run_main

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

#: Rows that would run in seconds, were the settings good.
SELECTION = ("-k", "exec_order and train_eval", "--rank-mode", "thread")


def _run(tmp_path: Path, *args: str) -> tuple[MainResult, Path]:
    report = tmp_path / "r.json"
    return run_main(cli.main, "run", *SELECTION, "--json", str(report), *args), report


def _assert_nothing_ran(result: MainResult, report: Path) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == exitcodes.USAGE_ERROR, output[-3000:]
    assert "conformance matrix" not in output and "[1/" not in output and "[   1" not in output, output[-3000:]
    assert "INTERNALERROR" not in output and "Traceback" not in output, output[-3000:]
    assert not report.exists()


@pytest.mark.parametrize(("variable", "value", "accepted"), [
    ("FSDP_BASELINE_CACHE", "maybe", "expected one of on, off, verify"),
    ("FSDP_CONCURRENT_WORKERS", "zero", "expected a whole number >= 1"),
    ("FSDP_CONCURRENT_WORKERS", "0", "expected a whole number >= 1"),
    ("FSDP_HARNESS_START_METHOD", "fork", "expected one of forkserver, spawn"),
    ("FSDP_BASELINE_CACHE_LOG", "/proc/baseline.log", "cannot append to it"),
    ("FSDP_BENCH_CPU_LOG", "/", "is a directory"),
    ("FSDP_FUZZ_SEED", "-1", "expected a whole number >= 0"),
    ("FSDP_CONFORMANCE_MAX_TIME", "soon", "expected a whole number >= 1"),
])
def test_a_bad_variable_is_a_usage_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str,
                                                   value: str, accepted: str) -> None:
    monkeypatch.setenv(variable, value)
    result, report = _run(tmp_path)
    _assert_nothing_ran(result, report)
    assert f"{variable}={value!r}: {accepted}" in result.stderr, result.stderr[-3000:]


def test_a_bad_variable_is_reported_even_when_the_command_line_overrides_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_RANK_MODE", "bogus")  # SELECTION gives --rank-mode thread
    result, report = _run(tmp_path)
    _assert_nothing_ran(result, report)
    assert "FSDP_RANK_MODE='bogus': expected one of both, process, thread, launched" in result.stderr


def test_a_bad_adapter_entry_names_the_entry_not_the_default_adapter(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", "mine=my_package.adapter:Mine,foo")
    result, report = _run(tmp_path)
    _assert_nothing_ran(result, report)
    assert "FSDP_CONFORMANCE_ADAPTERS='mine=my_package.adapter:Mine,foo': entry 'foo' is not name=module:Class" \
        in result.stderr, result.stderr[-3000:]
    assert "adapter 'reference'" not in result.stdout + result.stderr


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("missing.json", None, "cannot read findings: [Errno 2] No such file or directory"),
    ("truncated.json", '[{"impl": "reference",', "cannot read findings: Expecting"),
    ("object.json", '{"impl": "reference"}', "expected a JSON list of findings, got dict"),
    ("fields.json", '[{"impl": "reference", "rows": "exec_order/*"}]', "a finding is {'impl', 'rows', 'doc'}"),
    ("pattern.json", '[{"impl": "reference", "rows": "exec_order/x[flag]", "doc": "d.md"}]',
     "rows: row id 'exec_order/x[flag]': 'flag' is not name=value"),
])
def test_a_bad_findings_file_is_a_usage_error_naming_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              name: str, text: str | None, problem: str) -> None:
    good, bad = tmp_path / "good.json", tmp_path / name
    good.write_text("[]")
    if text is not None:
        bad.write_text(text)
    monkeypatch.setenv("FSDP_CONFORMANCE_FINDINGS", os.pathsep.join([str(good), str(bad)]))
    result, report = _run(tmp_path)
    _assert_nothing_ran(result, report)
    assert f"FSDP_CONFORMANCE_FINDINGS={os.pathsep.join([str(good), str(bad)])!r}: {bad}: {problem}" \
        in result.stderr, result.stderr[-3000:]


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc on this platform")
@pytest.mark.parametrize("option", ["--json", "--junitxml", "--markdown", "--html"])
def test_a_report_path_under_proc_is_a_usage_error_naming_it(tmp_path: Path, option: str) -> None:
    """``os.access`` says a root process may write in ``/proc``; no file can be created there."""
    path = "/proc/r.report"
    result = run_main(cli.main, "run", *SELECTION, option, path)
    _assert_nothing_ran(result, tmp_path / "never.json")
    assert f"report {path}: cannot create a file in /proc" in result.stderr, result.stderr[-3000:]


def test_version_names_the_suite_torch_and_python() -> None:
    import platform
    from importlib.metadata import version

    import torch

    result = run_main(cli.main, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == (f"fsdp-conformance {version('fsdp-conformance')} (torch {torch.__version__}, "
                                     f"Python {platform.python_version()})")


def test_list_and_impls_refuse_bad_settings_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_BASELINE_CACHE", "maybe")
    listed = run_main(cli.main, "list", "-k", "exec_order")
    assert listed.returncode == exitcodes.USAGE_ERROR and "exec_order/" not in listed.stdout
    assert "FSDP_BASELINE_CACHE='maybe': expected one of on, off, verify" in listed.stderr, listed.stderr
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", "foo")
    impls = run_main(cli.main, "impls")
    assert impls.returncode == exitcodes.USAGE_ERROR and "reference" not in impls.stdout
    assert "FSDP_CONFORMANCE_ADAPTERS='foo': entry 'foo' is not name=module:Class" in impls.stderr, impls.stderr
