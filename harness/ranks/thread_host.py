"""Thread ranks run in a host process of their own, started once per placement and reused.

[Note: thread host]
A thread rank that segfaults, calls ``os._exit`` or gets a fatal signal takes
its whole process with it. So thread-rank runs never execute in the caller:
a *thread host* (forked from the same forkserver as rank processes, see
[Note: process start]) receives each run over a pipe, runs it with
:func:`harness.ranks.threads.run_threads` and sends back the values or the
exception. The parent waits on the pipe and on the host's sentinel, so a
host's death is a :class:`~harness.ranks.errors.RankDied` naming the rank that
caused it (from ``os._exit``'s note or the crash dump's current thread, see
:mod:`harness.ranks._host_main`) and the host; the next run starts a fresh host.
The host enforces the run's timeout itself; if it does not answer
:data:`HOST_MARGIN_S` after that, its stacks are dumped and it is killed.
Under the ``cpu`` placement the host hides CUDA like a rank process does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from harness.ranks._host_main import HostSetup, ThreadTask, host_main
from harness.ranks.errors import RankError, make_failure
from harness.ranks.outcome import skip_exception
from harness.ranks.process import mp_context, read_text
from harness.ranks.rank_mode import RankMode
from harness.ranks.threads import STOP_GRACE_S

__all__ = ["ThreadHost", "run_in_host", "shutdown_hosts", "HOST_MARGIN_S"]

#: How long past a run's own timeout (and stop grace) the parent waits for the host's answer.
HOST_MARGIN_S = 10.0

_hosts: dict[str, ThreadHost] = {}
_lock = threading.Lock()
_CURRENT_THREAD = re.compile(r"^Current thread (0x[0-9a-fA-F]+)", re.MULTILINE)


class ThreadHost:
    """One host process for thread-rank runs under ``placement``."""

    def __init__(self, placement: str, gpus: int) -> None:
        self.placement = placement
        self.sys_path = list(sys.path)
        self.tmpdir = tempfile.mkdtemp(prefix=f"fsdp-harness-{os.getpid()}-host-")
        ctx = mp_context()
        self.conn, child_end = ctx.Pipe()
        setup = HostSetup(placement=placement, gpus=gpus, sys_path=self.sys_path, parent_pid=os.getpid(),
                          stack_path=self._path("stack"), crash_path=self._path("crash"),
                          ranks_path=self._path("ranks"))
        self.proc = ctx.Process(target=host_main, args=(setup, child_end), name=f"thread-host-{placement}",
                                daemon=True)
        self.closed = False
        try:
            self.proc.start()
        except BaseException:  # e.g. a stop signal while starting: leave no directory behind
            self.conn.close()
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.closed = True
            raise
        finally:
            child_end.close()

    def _path(self, what: str) -> str:
        return os.path.join(self.tmpdir, what)

    def run(self, job: ThreadTask) -> list[Any]:
        """Values of the run in rank order, or the exception that describes it."""
        self.conn.send(job)
        limit = job.timeout_s + STOP_GRACE_S + HOST_MARGIN_S
        ready = wait([self.conn, self.proc.sentinel], timeout=limit)
        reply = self._receive() if self.conn in ready else None
        if reply is not None:
            kind, value = reply
            if kind == "ok":
                return list(value)
            if kind == "failure":
                raise value
            if value.is_skip:
                raise skip_exception(value)
            raise RuntimeError(f"the thread host failed: {value.exc_type}: {value.message}\n{value.traceback}")
        if ready:
            raise self._death(job.world_size)
        raise self._unresponsive(job.world_size, limit)

    def _receive(self) -> tuple[str, Any] | None:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def _death(self, world_size: int) -> BaseException:
        detected_at = time.time()
        self.proc.join(timeout=2.0)
        code = self.proc.exitcode
        signal_name = signal.Signals(-code).name if code is not None and code < 0 else None
        crash = read_text(self._path("crash"))
        culprit, known = _culprit(read_text(self._path("ranks")), crash)
        host = f"the thread host (pid {self.proc.pid}) exited without reporting a result"
        summary = host if known else f"{host}; which rank caused it is unknown"
        errors = [RankError(culprit, "died", summary, exitcode=code, signal_name=signal_name, stack=crash,
                            detected_at=detected_at)]
        errors += [RankError(r, "aborted", f"its thread host died with rank {culprit}")
                   for r in range(world_size) if r != culprit]
        return make_failure(errors, world_size=world_size, mode=RankMode.THREAD)

    def _unresponsive(self, world_size: int, limit: float) -> BaseException:
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(0.3)
        except ProcessLookupError:
            pass
        stack = read_text(self._path("stack")) or "(no stack: the host did not respond)"
        errors = [RankError(r, "timed_out", f"the thread host (pid {self.proc.pid}) gave no result after "
                            f"{limit:g} s", stack=stack if r == 0 else "") for r in range(world_size)]
        return make_failure(errors, world_size=world_size, mode=RankMode.THREAD)

    def close(self, *, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(None)
            self.proc.join(timeout=5.0)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5.0)
        self.conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _culprit(log: str, crash: str) -> tuple[int, bool]:
    """The rank that killed the host: ``(rank, True)``, or ``(lowest started rank, False)``."""
    idents: dict[int, int] = {}
    for line in log.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "exit":
            return int(parts[1]), True
        if len(parts) == 3 and parts[0] == "start":
            idents[int(parts[2])] = int(parts[1])
    match = _CURRENT_THREAD.search(crash)
    if match and int(match.group(1), 16) in idents:
        return idents[int(match.group(1), 16)], True
    return min(idents.values(), default=0), False


def run_in_host(job: ThreadTask, placement: str, gpus: int) -> list[Any]:
    """Run ``job`` in the host for ``placement`` (started on first use, replaced after it dies or hangs, or
    when ``sys.path`` changed since it started, as a process pool is: [Note: process pool lifecycle])."""
    if not _lock.acquire(blocking=False):
        raise RuntimeError("another thread-rank run is active in this process; thread runs cannot overlap")
    try:
        host = _hosts.get(placement)
        if host is not None and host.sys_path != sys.path:
            del _hosts[placement]
            host.close(graceful=True)
            host = None
        if host is None or host.closed or not host.proc.is_alive():
            host = _hosts[placement] = ThreadHost(placement, gpus)
        try:
            return host.run(job)
        except BaseException as exc:
            # A collective mismatch is a timeout or a failure in a collective seen from the other side: the
            # waiting rank threads may not have stopped, so the host goes too.
            if isinstance(exc, KeyboardInterrupt) or getattr(exc, "kind", None) in ("died", "timed_out", "collective"):
                _discard(host)
            raise
    finally:
        _lock.release()


def _discard(host: ThreadHost) -> None:
    if _hosts.get(host.placement) is host:
        del _hosts[host.placement]
    host.close(graceful=False)


def shutdown_hosts() -> None:
    """Stop every thread host (also at interpreter exit)."""
    for host in list(_hosts.values()):
        if _hosts.get(host.placement) is host:
            del _hosts[host.placement]
        host.close(graceful=True)


atexit.register(shutdown_hosts)
