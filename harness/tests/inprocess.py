"""Running a pytest session, or a command's ``main``, inside the test's own process.

[Note: in-process sessions]
A test that starts a fresh interpreter pays for the interpreter, torch's import,
collection and, when ranks run as processes, a forkserver that imports torch
again. In-process, the nested session shares this process's imports and
multiprocessing's forkserver; it stays equal to a fresh process because:

* Imports. ``pytester`` restores ``sys.modules`` after each in-process run and
  at teardown, dropping what was imported since. Torch cannot be imported a
  second time (its modules register operators once per process), so
  :func:`preloaded`, a session fixture set up before any ``pytester``, imports
  :data:`PRELOAD` first, and :func:`pytester_run` fails naming any torch module
  a nested run imported that the snapshot then dropped: add it to
  :data:`PRELOAD` (or leave that test in a subprocess).
* pytest-timeout. The nested session's tests keep their own timeouts, as in
  a process of their own; pytest-timeout arms ``SIGALRM`` for each and
  cancels it after, which would take the outer test's timeout with it, so the
  outer test's handler and alarm are put back after the nested session, less
  the time it took (already spent, the outer timeout fires at once).
* Environment. Settings, the adapter registry and the known findings read
  ``os.environ`` when a session asks, so what a test sets with ``monkeypatch``
  is what the nested session sees; an import path goes on ``sys.path``
  (``pytester.syspathinsert``), where a subprocess would read ``PYTHONPATH``.
  Process ranks do not see such a change: they fork from multiprocessing's
  forkserver, whose environment is the one it started with, perhaps in an
  earlier test. So a test whose ranks must read a variable it sets (the
  baseline cache's ``FSDP_BASELINE_CACHE``, say) stays in a subprocess.
* Output and exit codes. :func:`run_main` captures ``sys.stdout`` and
  ``sys.stderr`` (where pytest's terminal and argparse write) and turns
  ``SystemExit`` into the exit code, as ``sys.exit(main())`` would.

What is about processes (signals, xdist workers, torchrun, clean-up after the
interpreter exits, the installed entry point itself) stays in subprocesses.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["PRELOAD", "MainResult", "preloaded", "pytester_run", "run_main"]

#: What nested sessions import that must never be imported twice: torch's modules that the
#: harness, the adapters and the cases use, and the harness's rank processes' own.
PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo", "multiprocessing.forkserver",
    "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torch.distributed.device_mesh", "torch.testing",
    "harness.ranks.process", "harness.ranks.runner", "harness.ranks._rank_main", "harness.ranks._host_main",
)


def _import_all() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


@pytest.fixture(scope="session")
def preloaded() -> None:
    """:data:`PRELOAD` imported, before any ``pytester`` snapshot of ``sys.modules``."""
    _import_all()


class _Recorder:
    """A plugin of the nested session: the modules imported when it ends."""

    def __init__(self) -> None:
        self.modules: set[str] = set()

    def pytest_unconfigure(self) -> None:
        self.modules = set(sys.modules)


@contextlib.contextmanager
def _outer_timeout_restored() -> Iterator[None]:
    """The outer test's ``SIGALRM`` handler and alarm (its pytest-timeout), put back after the nested session."""
    handler = signal.getsignal(signal.SIGALRM)
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGALRM, handler)
        left = remaining - (time.monotonic() - start)
        signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3) if remaining > 0 else 0, interval)


def pytester_run(pytester: pytest.Pytester, *args: str, workers: Sequence[str] = ()) -> pytest.RunResult:
    """``pytester.runpytest_inprocess(*args)`` with the suite's plugins under [Note: in-process sessions]; the
    test's directory is importable, as ``PYTHONPATH`` made it for a subprocess. Requires the :func:`preloaded` fixture.
    With ``workers`` (xdist's ``-n N``), a subprocess: its workers are processes of their own anyway."""
    args = ("-p", "conformance.pytest_plugin", *args)  # the suite's plugins: [Note: opt-in plugins]
    if workers:
        return pytester.runpytest_subprocess(*args, *workers)
    if "torch._dynamo" not in sys.modules:
        raise RuntimeError("pytester_run needs the 'preloaded' fixture, set up before pytester")
    pytester.syspathinsert()
    recorder = _Recorder()
    with _outer_timeout_restored():
        result = pytester.runpytest_inprocess(*args, plugins=[recorder])
    dropped = sorted(name for name in recorder.modules - set(sys.modules)
                     if name == "torch" or name.startswith("torch."))
    assert not dropped, f"the nested session imported {dropped}, which cannot be imported twice: add to PRELOAD"
    return result


@dataclass(frozen=True)
class MainResult:
    """What a fresh ``python -m`` process would have given: exit code and output."""

    returncode: int
    stdout: str
    stderr: str


def run_main(main: Callable[[Sequence[str]], Any], *argv: str) -> MainResult:
    """``sys.exit(main(argv))`` in this process under [Note: in-process sessions]: its exit code
    and what it wrote to ``sys.stdout`` and ``sys.stderr``."""
    _import_all()
    out, err = io.StringIO(), io.StringIO()
    with _outer_timeout_restored(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=err)
        code = 1
    return MainResult(code, out.getvalue(), err.getvalue())
