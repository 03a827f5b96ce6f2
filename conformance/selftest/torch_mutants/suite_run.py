"""Run the suite's rows once, in a subprocess under an overlay, with a time limit.

The run is ``python -m conformance run --impl IMPL [-k EXPR] [--rank-mode MODE]
--json REPORT`` in a session of its own, so that a run over its limit is
stopped with everything it started (its forkserver, ranks and thread hosts):
SIGTERM to the session's process group first (the run then writes its report
and removes its temporary directories), SIGKILL after :data:`GRACE_S`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from conformance.selftest.torch_mutants.injection import Overlay, overlay_env, read_markers
from conformance.selftest.torch_mutants.verdicts import RunResult

__all__ = ["GRACE_S", "Selection", "run_rows"]

#: How long a run over its limit gets between SIGTERM and SIGKILL.
GRACE_S = 20.0


@dataclass(frozen=True)
class Selection:
    """The rows every run of a campaign runs: one implementation, a ``-k`` expression, a rank mode."""

    impl: str
    keyword: str | None = None
    rank_mode: str | None = None

    def command(self, report: Path) -> list[str]:
        cmd = [sys.executable, "-m", "conformance", "run", "--impl", self.impl, "--json", str(report)]
        if self.keyword:
            cmd += ["-k", self.keyword]
        if self.rank_mode:
            cmd += ["--rank-mode", self.rank_mode]
        return cmd


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for ``proc``; stop its process group past ``timeout_s``. Whether it was stopped."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        return True
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # what the run left behind in its group, if anything


def _load(report: Path) -> dict[str, object] | None:
    try:
        loaded = json.loads(report.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def run_rows(selection: Selection, overlay: Overlay, workdir: Path, timeout_s: float,
             environ: Mapping[str, str] | None = None) -> RunResult:
    """Run ``selection``'s rows under ``overlay``; its report and log go to ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "report.json"
    env = overlay_env(overlay, os.environ if environ is None else environ)
    start = time.monotonic()
    with open(workdir / "run.log", "wb") as log:
        proc = subprocess.Popen(selection.command(report), stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = _wait(proc, timeout_s)
    wall = time.monotonic() - start
    return RunResult(None if timed_out else proc.returncode, timed_out, wall, _load(report), read_markers(overlay),
                     controller=proc.pid)
