"""A temporary directory too long for the forkserver's socket is named before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.ranks import process


def test_a_long_temp_dir_is_refused_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    long_dir = tmp_path / ("d" * (process.UNIX_PATH_MAX - len(str(tmp_path))))
    monkeypatch.setattr("tempfile.tempdir", str(long_dir))
    with pytest.raises(ValueError, match=r"too long for rank processes: the forkserver's socket path would take "
                                         r"\d+ bytes and AF_UNIX allows 107; set TMPDIR to a shorter directory"):
        process.check_socket_path()
    monkeypatch.setattr("tempfile.tempdir", "/tmp")
    process.check_socket_path()


@pytest.mark.first_torch  # process lifetimes and temp dirs: [Note: tests on the first torch]
def test_a_session_with_a_long_temp_dir_is_a_usage_error(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * (process.UNIX_PATH_MAX - len(str(tmp_path))))
    long_dir.mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conformance.pytest_plugin",
                           "--co", "-q", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "TMPDIR": str(long_dir)}, timeout=120,
                          check=False)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "AF_UNIX allows 107" in done.stderr and "Traceback" not in done.stderr
