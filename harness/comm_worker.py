"""A per-rank communication worker: a CPU stand-in for a CUDA communication stream.

[Note: communication worker]
On a GPU, FSDP overlaps communication with compute because collectives run on
a separate stream. On CPU there is no such stream: gloo runs a collective on
the calling thread. :func:`comm_worker` intercepts the collectives of one rank
(through :func:`harness.recorder.patch_collectives`) and runs them, in issue
order, on one worker thread per rank, each first sleeping ``comm_ms`` (the
stand-in for transfer time; ``time.sleep`` releases the GIL). The caller gets
a handle at once when it asked for ``async_op=True`` and waits only when it
calls ``wait()``; with ``async_op=False`` the caller blocks until the worker
finished, exactly as the real call would. Arguments are bound to the
collective's real signature (``inspect.signature(fn).bind``), so ``async_op``
is found whether it was passed by keyword or by position (torch's deprecated
``_all_gather_base`` forwards it positionally). So an implementation that issues
collectives asynchronously and waits late overlaps them with compute, and one
that blocks does not. Every collective's issue, start and end times are kept
for evidence (:attr:`CommWorker.timeline`).

Process ranks only: under thread ranks the threaded group resolves the
calling thread's world, which a worker thread does not have.
"""

from __future__ import annotations

import functools
import inspect
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from harness.recorder import patch_collectives

__all__ = ["CommWorker", "Event", "comm_worker"]


@dataclass
class Event:
    """One collective on the worker, times in ms since the worker started."""

    op: str
    issued_ms: float
    started_ms: float = -1.0
    ended_ms: float = -1.0


class _Handle:
    """What an intercepted ``async_op=True`` collective returns: a Work-like handle."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        if hasattr(self._result, "wait"):
            self._result.wait()
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def result(self) -> Any:
        self.wait()
        return self._result.result() if hasattr(self._result, "result") else self._result


@dataclass
class CommWorker:
    """One rank's communication thread (see [Note: communication worker])."""

    comm_ms: float
    ops: frozenset[str]
    timeline: list[Event] = field(default_factory=list)
    _queue: queue.Queue[Any] = field(default_factory=queue.Queue)
    _origin: float = field(default_factory=time.perf_counter)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="comm-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                raise RuntimeError("communication worker did not stop within 60 s (a collective is stuck)")

    def drain(self) -> None:
        """Block until every collective issued so far has finished."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    def _now(self) -> float:
        return (time.perf_counter() - self._origin) * 1e3

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # drain marker: everything before it is done
                item.set()
                continue
            event, fn, bound, handle = item
            event.started_ms = self._now()
            try:
                time.sleep(self.comm_ms / 1e3)
                result = fn(*bound.args, **bound.kwargs)
                handle._finish(result, None)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                handle._finish(None, exc)
            event.ended_ms = self._now()

    def __call__(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op not in self.ops:
            return fn(*args, **kwargs)
        bound = _bind(fn, args, kwargs)
        if "async_op" not in bound.signature.parameters:
            raise TypeError(f"{op}: {fn.__name__}{bound.signature} has no async_op parameter; "
                            "the communication worker cannot run it asynchronously")
        asynchronous = bool(bound.arguments["async_op"])
        bound.arguments["async_op"] = False  # the worker thread runs it to completion
        event = Event(op, issued_ms=self._now())
        self.timeline.append(event)
        handle = _Handle()
        self._queue.put((event, fn, bound, handle))
        if asynchronous:
            return handle
        handle.wait()
        return None

    def render(self) -> str:
        """The timeline as text: op, issued, started, ended (ms)."""
        return "\n".join(f"{e.op:24s} issued {e.issued_ms:8.1f}  start {e.started_ms:8.1f}  end {e.ended_ms:8.1f}"
                         for e in self.timeline)


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _bind(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """``args``/``kwargs`` bound to ``fn``'s signature, defaults filled in (a bad call raises here, in the caller)."""
    bound = _signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


DEFAULT_OPS = frozenset({"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather",
                         "reduce_scatter", "broadcast"})


@contextmanager
def comm_worker(comm_ms: float, ops: frozenset[str] = DEFAULT_OPS) -> Iterator[CommWorker]:
    """Run this rank's collectives on a worker thread, each delayed by ``comm_ms``.

    Collective: every rank enters and leaves together. Collectives not routed
    through the worker (e.g. ``barrier``) must not be issued inside the block
    while routed ones are pending.
    """
    worker = CommWorker(comm_ms=comm_ms, ops=ops)
    worker.start()
    try:
        with patch_collectives(worker):
            try:
                yield worker
            finally:
                worker.drain()  # nothing in flight when the unpatching barrier runs
    finally:
        worker.stop()
