"""Per-rank warning capture that is correct when ranks are threads of one process.

[Note: per-rank warnings]
``warnings.catch_warnings`` swaps process-global state (the filter list and
``showwarning``) and is not thread-safe: under thread ranks, one rank leaving
its block would restore the filters while another rank is still inside. Here
the first active capture in the process installs, under a lock, an "always"
filter and a ``showwarning`` dispatcher; the dispatcher appends each warning
to the list of the *thread that issued it* (or forwards to the original
``showwarning`` for threads that are not capturing); the last capture to leave
restores both. A rank therefore sees exactly the warnings its own code raised.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

__all__ = ["capture"]

_lock = threading.Lock()
_local = threading.local()
_active = 0
_saved_filters: list[Any] = []
_saved_showwarning: Any = None


def _dispatch(message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: Any = None, line: str | None = None) -> None:
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].append(warnings.WarningMessage(message, category, filename, lineno, file, line))
    elif _saved_showwarning is not None:
        _saved_showwarning(message, category, filename, lineno, file, line)


def _install() -> None:
    global _active, _saved_showwarning
    with _lock:
        if _active == 0:
            _saved_filters[:] = warnings.filters[:]
            _saved_showwarning = warnings.showwarning
            warnings.simplefilter("always")
            warnings.showwarning = _dispatch
        _active += 1


def _uninstall() -> None:
    global _active, _saved_showwarning
    with _lock:
        _active -= 1
        if _active == 0:
            cast(list, warnings.filters)[:] = _saved_filters
            warnings._filters_mutated()  # type: ignore[attr-defined]
            warnings.showwarning = _saved_showwarning
            _saved_showwarning = None


@contextmanager
def capture() -> Iterator[list[warnings.WarningMessage]]:
    """Collect the warnings this thread issues inside the block (every occurrence)."""
    caught: list[warnings.WarningMessage] = []
    if not hasattr(_local, "stack"):
        _local.stack = []
    _install()
    _local.stack.append(caught)
    try:
        yield caught
    finally:
        _local.stack.pop()
        _uninstall()
