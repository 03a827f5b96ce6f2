"""Thread ranks: every rank is a thread of one process (the thread host, :mod:`harness.ranks.thread_host`).

[Note: thread ranks]
Each rank thread initialises its own default group on the threaded backend
(:mod:`harness.ranks._torch_threadlocal`) over a fresh in-process ``HashStore``.
The first rank to raise aborts every collective, so ranks waiting for it wake
up (reported as ``aborted``, not blamed) and a failure never becomes a hang.
At the timeout the runner records every unfinished rank's stack, aborts
collectives, and asks the remaining threads to stop with an asynchronous
exception; a thread that still does not stop is reported loudly. Process-
global state (environment, warning filters, debug level, patched
``torch.distributed`` attributes) is restored after the run, and the threaded
world is uninstalled. Only one thread-rank run may be active per process.
Ranks compute on the device their placement gives them (:func:`harness.ranks.devices.rank_device`).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import harness.ranks._torch_threadlocal as tl
from harness.collectives.recorder import observe_thread, observing
from harness.collectives.sequence import SLOT_SIZE, Slot, attributed
from harness.ranks.context import RankContext
from harness.ranks.devices import rank_device
from harness.ranks.errors import RankError, RankFailure, make_failure
from harness.ranks.outcome import Outcome, capture, resolve
from harness.ranks.rank_mode import RankMode
from harness.ranks.reset import process_global_scope, seed_everything

__all__ = ["ThreadRun", "run_threads", "STOP_GRACE_S"]

#: How long stopped threads get to unwind after the timeout before being reported as stuck.
STOP_GRACE_S = 2.0

_RUN_LOCK = threading.Lock()


class RankThreadStopped(BaseException):
    """Injected into a rank thread that is still running at the timeout."""


@dataclass(frozen=True)
class ThreadRun:
    """One thread-rank run: the body, its arguments, and where the ranks compute."""

    fn: Callable[..., Any]
    world_size: int
    timeout_s: float
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    env: Mapping[str, str] | None = None
    placement: str = "cpu"
    gpus: int = 0
    #: Called on each rank's thread as it starts, with the rank (e.g. to map thread ids to ranks).
    started: Callable[[int], None] | None = None

    def device(self, rank: int) -> torch.device:
        return rank_device(self.placement, rank, self.gpus)


def _rank_body(run: ThreadRun, rank: int, store: Any, out: dict[int, Outcome], slot: Slot) -> None:
    world_size, seed = run.world_size, run.seed
    observe_thread(slot)
    try:
        if run.started is not None:
            run.started(rank)
        device = run.device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        dist.init_process_group(tl.BACKEND, rank=rank, world_size=world_size, store=store)
        ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                          device=device, backend=tl.BACKEND, mode=RankMode.THREAD, seed=seed)
        out[rank] = Outcome(rank=rank, ok=True, value=run.fn(ctx, *run.args, **run.kwargs))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        aborted = tl.is_abort(exc)
        out[rank] = capture(rank, exc, aborted=aborted)
        if not aborted and not out[rank].is_skip:
            tl.abort()
    finally:
        observe_thread(None)
        with contextlib.suppress(Exception):  # the group may never have been created
            dist.destroy_process_group()


def run_threads(run: ThreadRun) -> list[Any]:
    """Per-rank values of ``run`` in rank order, or the :class:`RankFailure` / skip that describes it."""
    if not _RUN_LOCK.acquire(blocking=False):
        raise RuntimeError("another thread-rank run is active in this process; thread runs cannot overlap")
    try:
        with process_global_scope(run.env):
            return _run_locked(run)
    finally:
        _RUN_LOCK.release()


def _run_locked(run: ThreadRun) -> list[Any]:
    world_size, timeout_s = run.world_size, run.timeout_s
    tl.reset()
    tl.install(run.device(0).type)
    seed_everything(run.seed)
    out: dict[int, Outcome] = {}
    store = dist.HashStore()
    slots = [Slot(bytearray(SLOT_SIZE)) for _ in range(world_size)]
    threads = [
        threading.Thread(target=_rank_body, name=f"rank{r}", daemon=True, args=(run, r, store, out, slots[r]))
        for r in range(world_size)
    ]
    try:
        with observing():  # before the rank threads start: none is in a collective
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            late = [r for r, t in enumerate(threads) if t.is_alive()]
            try:
                if late:
                    raise make_failure(_stop(threads, late, timeout_s, out), world_size=world_size,
                                       mode=RankMode.THREAD)
                return resolve(list(out.values()), world_size=world_size, mode=RankMode.THREAD)
            except RankFailure as failure:
                raise attributed(failure, {r: slot.position(r) for r, slot in enumerate(slots)}) from None
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
