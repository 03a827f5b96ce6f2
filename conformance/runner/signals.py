"""SIGTERM, SIGINT and SIGHUP end a run the same way.

[Note: stop signals]
CI timeouts and cancellations send SIGTERM, a closed terminal SIGHUP, a
person Ctrl-C (SIGINT). Python's defaults differ: SIGINT raises
``KeyboardInterrupt``, which pytest turns into an orderly end, while SIGTERM
and SIGHUP kill the process on the spot (no matrix, no reports, temporary
directories and rank processes left behind). :func:`install` makes all three
raise ``KeyboardInterrupt`` in the main thread of every pytest process of the
run (the xdist controller and each worker: a signal sent to the process group
reaches all of them), remembering the first signal's name. From there the
run ends as pytest ends an interrupted session: the case in flight is
abandoned (the harness discards its ranks), the session finishes (pools and
thread hosts are stopped, their ``fsdp-harness-*`` directories removed), the
matrix is printed, every requested report is written with
``"interrupted": true`` and the signal's name, and the interpreter exits
normally, so multiprocessing removes its ``pymp-*`` directories. Signals
after the first are ignored while the run winds down, so a second Ctrl-C or
a CI's repeated SIGTERM cannot cut the reports short (SIGKILL still stops
it). ``fsdp-conformance run`` exits with :data:`~conformance.runner.exitcodes.INTERRUPTED`.

This module is the pytest plugin that does so for every session that loads
the suite (``-p conformance.pytest_plugin``). The signal lands on whatever instruction the main
thread is at; on Python 3.11 and later that can be one without a line number
(an exception-table cleanup), and pytest's own report of the interrupt,
which formats every frame, then raises ``TypeError`` from inside its
interrupt handling: the run would end with exit code 1, no matrix and no
reports. :func:`pytest_keyboard_interrupt` drops such frames from what
pytest formats first; the handler's own frame, which raised, always has one.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

__all__ = ["STOP_SIGNALS", "install", "received"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_received: list[str] = []


def received() -> str | None:
    """The name of the first stop signal this process received since :func:`install`, or ``None``."""
    return _received[0] if _received else None


def _stop(signum: int, frame: FrameType | None) -> None:
    if _received:
        return  # already winding down ([Note: stop signals])
    _received.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(f"stopped by {_received[0]}")


def install() -> Callable[[], None]:
    """Handle :data:`STOP_SIGNALS` as [Note: stop signals] says; returns the function that restores the
    previous handlers. Outside the main thread (signals cannot be handled there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _received.clear()
    previous: dict[int, Any] = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


_RESTORE_KEY = pytest.StashKey[Callable[[], None]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESTORE_KEY] = install()


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash.get(_RESTORE_KEY, lambda: None)()


@pytest.hookimpl(tryfirst=True)
def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """Keep only frames pytest can format ([Note: stop signals])."""
    excinfo.traceback = excinfo.traceback.filter(_has_line)


def _has_line(entry: Any) -> bool:
    try:
        entry.lineno  # noqa: B018 (the property raises TypeError when the frame's instruction has no line)
    except TypeError:
        return False
    return True
