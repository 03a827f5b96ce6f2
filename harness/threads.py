"""Thread ranks: every rank is a thread of the calling process.

[Note: thread ranks]
Each rank thread initialises its own default group on the threaded backend
(:mod:`harness._torch_threadlocal`) over a fresh in-process ``HashStore``.
The first rank to raise aborts every collective, so ranks waiting for it wake
up (reported as ``aborted``, not blamed) and a failure never becomes a hang.
At the timeout the runner records every unfinished rank's stack, aborts
collectives, and asks the remaining threads to stop with an asynchronous
exception; a thread that still does not stop is reported loudly. Process-
global state (environment, warning filters, debug level, patched
``torch.distributed`` attributes) is restored after the run, and the threaded
world is uninstalled. Only one thread-rank run may be active per process.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from harness import _torch_threadlocal as tl
from harness.context import RankContext
from harness.errors import RankError, make_failure
from harness.outcome import Outcome, capture, resolve
from harness.reset import process_global_scope, seed_everything

__all__ = ["run_threads", "STOP_GRACE_S"]

#: How long stopped threads get to unwind after the timeout before being reported as stuck.
STOP_GRACE_S = 2.0

_RUN_LOCK = threading.Lock()


class RankThreadStopped(BaseException):
    """Injected into a rank thread that is still running at the timeout."""


def _rank_body(rank: int, world_size: int, store: Any, seed: int, fn: Callable[..., Any],
               args: tuple[Any, ...], kwargs: Mapping[str, Any], out: dict[int, Outcome]) -> None:
    try:
        dist.init_process_group(tl.BACKEND, rank=rank, world_size=world_size, store=store)
        ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                          device=torch.device("cpu"), backend=tl.BACKEND, mode="thread", seed=seed)
        out[rank] = Outcome(rank=rank, ok=True, value=fn(ctx, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        aborted = tl.is_abort(exc)
        out[rank] = capture(rank, exc, aborted=aborted)
        if not aborted and not out[rank].is_skip:
            tl.abort()
    finally:
        with contextlib.suppress(Exception):  # the group may never have been created
            dist.destroy_process_group()


def run_threads(fn: Callable[..., Any], *, world_size: int, timeout_s: float, args: tuple[Any, ...],
                kwargs: Mapping[str, Any], seed: int, env: Mapping[str, str] | None) -> list[Any]:
    if not _RUN_LOCK.acquire(blocking=False):
        raise RuntimeError("another thread-rank run is active in this process; thread runs cannot overlap")
    try:
        with process_global_scope(env):
            return _run_locked(fn, world_size, timeout_s, args, kwargs, seed)
    finally:
        _RUN_LOCK.release()


def _run_locked(fn: Callable[..., Any], world_size: int, timeout_s: float, args: tuple[Any, ...],
                kwargs: Mapping[str, Any], seed: int) -> list[Any]:
    tl.reset()
    tl.install()
    seed_everything(seed)
    out: dict[int, Outcome] = {}
    store = dist.HashStore()
    threads = [
        threading.Thread(target=_rank_body, name=f"rank{r}", daemon=True,
                         args=(r, world_size, store, seed, fn, args, kwargs, out))
        for r in range(world_size)
    ]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        late = [r for r, t in enumerate(threads) if t.is_alive()]
        if late:
            raise make_failure(_stop(threads, late, timeout_s, out), world_size=world_size, mode="thread")
        return resolve(list(out.values()), world_size=world_size, mode="thread")
    finally:
        tl.uninstall()
        tl.reset()


def _stop(threads: list[threading.Thread], late: list[int], timeout_s: float,
          out: dict[int, Outcome]) -> list[RankError]:
    frames = sys._current_frames()
    stacks = {}
    for r in late:
        frame = frames.get(threads[r].ident or -1)
        stacks[r] = "".join(traceback.format_stack(frame)) if frame is not None else ""
    tl.abort()
    for r in late:
        ident = threads[r].ident
        if ident is not None and threads[r].is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(RankThreadStopped))
    for r in late:
        threads[r].join(STOP_GRACE_S)
    errors = [RankError(o.rank, "raised", f"{o.exc_type.rsplit('.', 1)[-1]}: {o.message}", traceback=o.traceback)
              for o in out.values() if not o.ok and not o.aborted and not o.is_skip
              and not o.exc_type.endswith("RankThreadStopped") and o.rank not in late]
    for r in late:
        stuck = threads[r].is_alive()
        note = " and could not be stopped (thread leaked until it returns)" if stuck else ""
        errors.append(RankError(r, "timed_out", f"no result after {timeout_s:g} s{note}", stack=stacks[r]))
    return errors
