"""Process ranks: a pool of spawned rank processes, reused across cases.

[Note: process pool lifecycle]
A pool is keyed by (world size, placement) ([Note: placements] in
:mod:`harness.ranks.devices`). Its ranks start with the caller's ``sys.path``, so a
pool started under another ``sys.path`` is replaced rather than reused: its
ranks could not import what the caller now can (a test directory an
in-process pytest session put on the path, say). Its ranks rendezvous
once through a ``FileStore`` in the pool's private temporary directory (no
ports, so concurrent suites never collide) and then run one task after another
(per-case reset: [Note: per-case reset]). The parent waits on every rank's
result pipe *and* process sentinel, so a death is seen at once. After any
failure or timeout the pool is torn down (ranks may be stuck in a collective
or hold a broken group) and the next case starts a fresh one; nothing
poisons later cases. Teardown kills survivors and removes the directory;
ranks also exit on their own if the parent dies.

A rank that dies names the tasks its process ran before (the last
:data:`HISTORY_SHOWN`, by test id and function): a task that ends cleanly can
still leave its process broken for a later one (a collective writing into
memory already freed corrupts the heap, and the crash comes at a later
allocation), so the failing task is not always the one at fault.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from harness import setting_sources
from harness.collectives.sequence import attributed, create_slot_file, read_slot_file
from harness.ranks._rank_main import RankSetup, Task, rank_main
from harness.ranks.cpu_budget import intra_op_threads
from harness.ranks.errors import RankError, RankFailure, make_failure
from harness.ranks.outcome import Outcome, as_error, resolve
from harness.ranks.rank_mode import RankMode

__all__ = ["ProcessPool", "get_pool", "discard_pool", "shutdown_pools", "mp_context", "preload_task_modules",
           "read_text", "task_label", "FAILURE_GRACE_S", "HISTORY_SHOWN", "START_METHOD_ENV", "START_METHODS",
           "start_method", "start_method_setting"]

#: After the first rank fails, how long the others get to report before they
#: are counted as aborted (they are usually blocked in a collective).
FAILURE_GRACE_S = 0.5
#: How many of the tasks a pool ran before are named when one of its ranks dies ([Note: process pool lifecycle]).
HISTORY_SHOWN = 3

# [Note: process start]
# Rank processes never inherit the test process's state: they come from
# multiprocessing's *forkserver*, a separately spawned, single-threaded server
# that has imported torch once and forks a clean child per rank. Children get
# spawn's isolation (no CUDA context, no threads, no test state from the
# parent) without paying torch's import on every start, which matters because
# a pool is replaced after every failure. FSDP_HARNESS_START_METHOD=spawn
# selects plain spawn.
START_METHOD_ENV = "FSDP_HARNESS_START_METHOD"
#: The values of :data:`START_METHOD_ENV`.
START_METHODS = ("forkserver", "spawn")


def start_method_setting(environ: Mapping[str, str] | None = None) -> setting_sources.Resolved[str]:
    """How rank processes start, from :data:`START_METHOD_ENV`; a bad value is a
    :class:`~harness.setting_sources.SettingError` naming the variable (checked when a session is configured)."""
    env = os.environ if environ is None else environ
    return setting_sources.resolve("start method", [(START_METHOD_ENV, env.get(START_METHOD_ENV))],
                                   setting_sources.choice(START_METHODS), "forkserver")


def start_method() -> str:
    """:func:`start_method_setting`'s value for this process's environment."""
    return start_method_setting().value

#: The longest AF_UNIX socket path Linux accepts (``sun_path`` holds 108 bytes with the terminating NUL).
UNIX_PATH_MAX = 107


def check_socket_path() -> None:
    """Raise ``ValueError`` when the forkserver's socket, which multiprocessing puts at
    ``<temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX``, would not fit in an AF_UNIX address: every rank start
    would otherwise fail with a bare ``OSError: AF_UNIX path too long``."""
    if start_method() != "forkserver":
        return
    tmp = tempfile.gettempdir()
    length = len(os.fsencode(os.path.join(tmp, "pymp-" + "x" * 8, "listener-" + "x" * 8)))
    if length > UNIX_PATH_MAX:
        raise ValueError(
            f"the temporary directory {tmp!r} ({len(tmp)} characters, from TMPDIR) is too long for rank "
            f"processes: the forkserver's socket path would take {length} bytes and AF_UNIX allows "
            f"{UNIX_PATH_MAX}; set TMPDIR to a shorter directory (or {START_METHOD_ENV}=spawn)"
        )


#: What the forkserver imports once; none of it may probe CUDA (a ``cpu`` placement hides it later).
#: ``torch._dynamo`` is imported by the first optimizer a rank builds (seconds per process otherwise).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "harness.ranks._rank_main", "harness.ranks._host_main"]
_task_modules: list[str] | None = None  # named once per process ([Note: preloaded task modules])


def preload_task_modules(names: Iterable[str]) -> list[str]:
    """Have the forkserver also import ``names``, the modules the coming tasks' functions live in, when it
    starts ([Note: preloaded task modules]); returns the names taken: those this process has imported, on the
    first call in a process (a later call, from a session nested in another, takes none). A forkserver already running
    keeps what it has.

    [Note: preloaded task modules]
    A rank resolves its task's function by importing the function's module, and with it whatever that
    module imports (for a conformance case: the fuzzer and hypothesis, torch's checkpointing and
    ``torch.distributed.optim``): about 0.3 CPU-seconds in each rank process and thread host, paid by every
    one of them, and made after the rank froze its imports ([Note: frozen imports]), so that every
    ``gc.collect()`` a case makes walks it. A session knows its tests' modules once it has collected them;
    imported by the forkserver, they are imported once, before the forks, and frozen with torch. Three
    guards keep the forkserver a clean parent:

    - CUDA. A module that probes CUDA as it is imported (``torch.cuda.is_available()`` in a skip marker)
      would initialize the driver in the process every rank forks from. The forkserver imports the task
      modules between ``harness.ranks._preload_begin`` and ``_preload_end`` (the fence), which make torch's
      CUDA probes raise an ``ImportError``: the forkserver skips such a module, and the rank imports it itself
      after its placement, as it would without preloading.
    - Failures. The forkserver skips a module that raises ``ImportError`` but dies of any other exception,
      so only modules this process has already imported are named, and between the two fence modules a
      task module's import that raises anything else raises an ``ImportError`` instead: such a module, too,
      is left to the ranks, which report what goes wrong.
    - Stale modules. A module imported by the forkserver is what every later pool's ranks resolve, so
      the modules are named once per process, by its first session; a session nested in a test (whose
      test files pytester writes anew, under names a later nested session reuses) names none."""
    global _task_modules
    if _task_modules is not None:
        return []
    _task_modules = sorted({name for name in names if name in sys.modules and name not in PRELOAD})
    return list(_task_modules)


def _forkserver_preload() -> list[str]:
    """What the forkserver imports: :data:`PRELOAD`, then the task modules behind the CUDA fence."""
    if not _task_modules:
        return list(PRELOAD)
    return [*PRELOAD, "harness.ranks._preload_begin", *_task_modules, "harness.ranks._preload_end"]


_pools: dict[tuple[int, str], ProcessPool] = {}


class ProcessPool:
    """``world_size`` spawned rank processes sharing one default process group."""

    def __init__(self, world_size: int, placement: str, gpus: int = 0) -> None:
        self.world_size = world_size
        self.placement = placement
        self.sys_path = list(sys.path)
        self.tmpdir = tempfile.mkdtemp(prefix=f"fsdp-harness-{os.getpid()}-")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.closed = False
        self.history: list[str] = []  # the tasks run to completion, oldest first
        try:
            self._start(gpus)
        except BaseException:  # e.g. a stop signal while starting: leave no process or directory behind
            self.close(graceful=False)
            raise

    def _start(self, gpus: int) -> None:
        ctx = mp_context()
        store_path = os.path.join(self.tmpdir, "store")
        for rank in range(self.world_size):
            create_slot_file(self._path("slot", rank))
            parent_end, child_end = ctx.Pipe()
            setup = RankSetup(
                rank=rank,
                world_size=self.world_size,
                placement=self.placement,
                gpus=gpus,
                intra_op_threads=intra_op_threads(self.world_size),
                store_path=store_path,
                sys_path=self.sys_path,
                parent_pid=os.getpid(),
                stack_path=self._path("stack", rank),
                crash_path=self._path("crash", rank),
                slot_path=self._path("slot", rank),
            )
            proc = ctx.Process(target=rank_main, args=(setup, child_end), name=f"rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def _path(self, what: str, rank: int) -> str:
        return os.path.join(self.tmpdir, f"{what}.{rank}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- running a task ----------------------------------------------------------
    def run(self, task: Task, timeout_s: float) -> list[Any]:
        """Run ``task`` on every rank; per-rank values or a :class:`RankFailure`."""
        for conn in self.conns:
            conn.send(task)
        try:
            results = self._results(timeout_s)
        except RankFailure as failure:
            positions = {r: read_slot_file(r, self._path("slot", r)) for r in range(self.world_size)}
            raise attributed(failure, positions) from None
        self.history.append(task_label(task))
        return results

    def _results(self, timeout_s: float) -> list[Any]:
        arrivals, pending = self._collect(timeout_s)
        outcomes = [a for a in arrivals if isinstance(a, Outcome)]
        if not pending and len(outcomes) == self.world_size:
            return resolve(outcomes, world_size=self.world_size, mode=RankMode.PROCESS)
        errors = [_as_error(a) for a in arrivals if not (isinstance(a, Outcome) and a.ok)]
        culprits = [e for e in errors if e.kind in ("raised", "died")]
        stacks = self._dump_stacks(pending)
        for rank in sorted(pending):
            if culprits:
                summary = f"did not finish after rank {culprits[0].rank} failed"
                errors.append(RankError(rank, "aborted", summary, stack=stacks[rank]))
            else:
                errors.append(RankError(rank, "timed_out", f"no result after {timeout_s:g} s", stack=stacks[rank]))
        raise make_failure(errors, world_size=self.world_size, mode=RankMode.PROCESS)

    def _collect(self, timeout_s: float) -> tuple[list[Outcome | RankError], set[int]]:
        """Results in arrival order (deaths before results seen in the same wakeup)."""
        deadline = time.monotonic() + timeout_s
        first_failure: float | None = None
        arrivals: list[Outcome | RankError] = []
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE_S)
            if now >= limit:
                break
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self.conns[rank]] = rank
                waitables[self.procs[rank].sentinel] = rank
            batch: list[Outcome | RankError] = []
            for ready in wait(list(waitables), timeout=limit - now):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                outcome = self._receive(rank)
                batch.append(self._death(rank) if outcome is None else outcome)
            batch.sort(key=lambda a: not isinstance(a, RankError))
            arrivals += batch
            if first_failure is None and any(_is_failure(a) for a in batch):
                first_failure = time.monotonic()
        return arrivals, pending

    def _receive(self, rank: int) -> Outcome | None:
        conn = self.conns[rank]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            return None
        return None

    def _death(self, rank: int) -> RankError:
        detected_at = time.time()
        proc = self.procs[rank]
        proc.join(timeout=2.0)
        code = proc.exitcode
        signal_name = signal.Signals(-code).name if code is not None and code < 0 else None
        crash = read_text(self._path("crash", rank))
        summary = "process exited without reporting a result"
        if self.history:  # [Note: process pool lifecycle]
            summary += (f"; its process had run {len(self.history)} earlier task(s), the last: "
                        f"{'; '.join(self.history[-HISTORY_SHOWN:])} (an earlier task can leave a process broken "
                        "for a later one)")
        return RankError(rank, "died", summary, exitcode=code, signal_name=signal_name, stack=crash,
                         detected_at=detected_at)

    def _dump_stacks(self, ranks: set[int]) -> dict[int, str]:
        for rank in ranks:
            if self.procs[rank].is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.3 if ranks else 0)
        silent = "(no stack: the process did not respond)"
        return {rank: read_text(self._path("stack", rank)) or silent for rank in ranks}

    # -- teardown ---------------------------------------------------------------------
    def close(self, *, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(OSError, BrokenPipeError):
                    conn.send(None)
            for proc in self.procs:
                proc.join(timeout=5.0)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def mp_context() -> Any:
    """A forkserver context whose server has torch imported ([Note: process start])."""
    method = start_method()
    ctx = mp.get_context(method)
    check_socket_path()
    if method == "forkserver":
        ctx.set_forkserver_preload(_forkserver_preload())
    return ctx


def task_label(task: Task) -> str:
    """What ran ``task``, for a later death's message: the pytest test (or case) and the function, or the
    function alone outside pytest."""
    module, qualname = task.fn_ref
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return f"{test} ({qualname})" if test else f"{module}.{qualname}"


def _is_failure(arrival: Outcome | RankError) -> bool:
    return isinstance(arrival, RankError) or (not arrival.ok and not arrival.is_skip)


def _as_error(arrival: Outcome | RankError) -> RankError:
    return arrival if isinstance(arrival, RankError) else as_error(arrival)


def read_text(path: str) -> str:
    """A file's text, or ``""`` when it cannot be read (e.g. a child never wrote it)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def get_pool(world_size: int, placement: str, gpus: int = 0, *, fresh: bool = False) -> ProcessPool:
    """The pool for this key, started on first use (or anew with ``fresh``, or when ``sys.path`` changed since
    it started: [Note: process pool lifecycle])."""
    key = (world_size, placement)
    pool = _pools.get(key)
    stale = pool is not None and pool.sys_path != sys.path
    if pool is not None and (fresh or stale or pool.closed or not all(p.is_alive() for p in pool.procs)):
        discard_pool(pool)
        pool = None
    if pool is None:
        pool = ProcessPool(world_size, placement, gpus)
        _pools[key] = pool
    return pool


def discard_pool(pool: ProcessPool, *, graceful: bool = False) -> None:
    key = (pool.world_size, pool.placement)
    if _pools.get(key) is pool:
        del _pools[key]
    pool.close(graceful=graceful)


def shutdown_pools() -> None:
    """Stop every pool (also runs at interpreter exit and at the end of a pytest session)."""
    for pool in list(_pools.values()):
        discard_pool(pool, graceful=True)


atexit.register(shutdown_pools)
