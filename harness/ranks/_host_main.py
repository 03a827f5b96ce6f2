"""The body of a thread host: a process that runs thread-rank runs, one after another.

The parent side is :mod:`harness.ranks.thread_host`; see [Note: thread host] there.
While a run is active the host keeps a small log (``ranks_path``) that lets
the parent name the rank behind a death: each rank thread writes
``start RANK THREAD_ID`` as it begins, and a rank that calls ``os._exit``
writes ``exit RANK CODE`` first (``os._exit`` is wrapped for the run).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import IO, Any

from harness.ranks._rank_main import Task, apply_placement, freeze_imports, prepare_child, resolve_fn
from harness.ranks.rank_mode import RankMode

__all__ = ["HostSetup", "ThreadTask", "host_main"]


@dataclass
class HostSetup:
    """What a thread host needs at start: its placement, the parent's import path, its dump files."""

    placement: str
    gpus: int
    sys_path: list[str]
    parent_pid: int
    stack_path: str
    crash_path: str
    ranks_path: str


@dataclass
class ThreadTask:
    """One thread-rank run, as sent to the host."""

    task: Task
    world_size: int
    timeout_s: float
    #: torch intra-op threads for each rank thread ([Note: intra-op threads] in :mod:`harness.ranks.cpu_budget`).
    intra_op_threads: int = 1


@contextmanager
def _rank_log(path: str) -> Iterator[Callable[[int], None]]:
    """A ``started(rank)`` callback for rank threads; ``os._exit`` notes the calling rank meanwhile."""
    log: IO[str] = open(path, "w")  # noqa: SIM115 - closed below
    ranks: dict[int, int] = {}
    real_exit = os._exit
    lock = threading.Lock()

    def write(line: str) -> None:
        with lock:
            log.write(line + "\n")
            log.flush()

    def started(rank: int) -> None:
        ranks[threading.get_ident()] = rank
        write(f"start {rank} {threading.get_ident()}")

    def noted_exit(code: int) -> None:
        rank = ranks.get(threading.get_ident())
        if rank is not None:
            write(f"exit {rank} {code}")
        real_exit(code)

    os._exit = noted_exit  # type: ignore[assignment]
    try:
        yield started
    finally:
        os._exit = real_exit
        log.close()


def _run(setup: HostSetup, job: ThreadTask) -> tuple[str, Any]:
    """``("ok", values)``, ``("failure", RankFailure)``, or ``("exception", Outcome)`` for anything else."""
    import torch

    from harness.ranks.errors import RankFailure
    from harness.ranks.outcome import capture
    from harness.ranks.threads import ThreadRun, run_threads

    # Rank threads start after this, so each picks the value up for its own parallel regions.
    torch.set_num_threads(job.intra_op_threads)
    task = job.task
    with _rank_log(setup.ranks_path) as started:
        run = ThreadRun(fn=resolve_fn(task.fn_ref), world_size=job.world_size, timeout_s=job.timeout_s,
                        args=task.args, kwargs=task.kwargs, seed=task.seed, env=task.env,
                        placement=setup.placement, gpus=setup.gpus, started=started)
        try:
            return "ok", run_threads(run)
        except RankFailure as exc:
            return "failure", exc
        except BaseException as exc:  # noqa: BLE001 - a skip every rank raised, or a harness error
            return "exception", capture(0, exc)


def _send(conn: Connection, reply: tuple[str, Any], world_size: int) -> None:
    try:
        conn.send(reply)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
        from harness.ranks.errors import RankError, make_failure

        error = RankError(0, "raised", f"TypeError: the thread ranks returned a value that does not pickle: {exc}")
        conn.send(("failure", make_failure([error], world_size=world_size, mode=RankMode.THREAD)))


def host_main(setup: HostSetup, conn: Connection) -> None:
    """Entry point of a thread host process."""
    prepare_child(setup.sys_path, setup.parent_pid, setup.crash_path, setup.stack_path)
    apply_placement(setup.placement)
    import torch.distributed  # noqa: F401 - imported before the freeze, as a rank process has it

    freeze_imports()  # [Note: frozen imports]
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        _send(conn, _run(setup, job), job.world_size)
