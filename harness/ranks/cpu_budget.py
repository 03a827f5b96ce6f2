"""How many torch intra-op threads each rank gets.

[Note: intra-op threads]
torch sizes its intra-op pool to the machine's cores in *every* process, so
``world_size`` rank processes (times the number of suites running at once,
e.g. pytest-xdist workers) each start that many threads and fight over the
cores: a bigger machine got slower. Each rank instead gets its share::

    threads = max(1, cores // (world_size * workers))

``cores`` is what this process may run on (``os.sched_getaffinity``, so a
container's or ``taskset``'s limit counts), ``workers`` the number of
concurrent runners sharing those cores. Rank processes set it once at start;
a thread host sets it before each run (all its rank threads share the process).

``workers`` comes from, in order: the caller's argument, ``FSDP_CONCURRENT_WORKERS``,
``PYTEST_XDIST_WORKER_COUNT`` (set by pytest-xdist in its workers), else 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from harness.setting_sources import Resolved, resolve, whole_number

__all__ = ["available_cores", "concurrent_workers", "intra_op_threads", "workers_setting", "WORKERS_ENV"]

#: Set this to the number of suites sharing the machine's cores (read by :func:`concurrent_workers`).
WORKERS_ENV = "FSDP_CONCURRENT_WORKERS"
_XDIST_ENV = "PYTEST_XDIST_WORKER_COUNT"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def workers_setting(environ: Mapping[str, str] | None = None) -> Resolved[int | None]:
    """:data:`WORKERS_ENV` alone (``None`` when unset); a bad value is a :class:`~harness.setting_sources.SettingError`
    naming the variable, checked when a session is configured."""
    env = os.environ if environ is None else environ
    return resolve("concurrent workers", [(WORKERS_ENV, env.get(WORKERS_ENV))], whole_number(1), None)


def concurrent_workers(environ: Mapping[str, str] | None = None) -> int:
    """Concurrent runners sharing the cores, from the environment (see the module docstring)."""
    env = os.environ if environ is None else environ
    given = workers_setting(env).value
    if given is not None:
        return given
    return resolve("concurrent workers", [(_XDIST_ENV, env.get(_XDIST_ENV))], whole_number(1), 1).value


def intra_op_threads(world_size: int, *, workers: int | None = None, cores: int | None = None) -> int:
    """Intra-op threads for one rank of a ``world_size`` run: ``max(1, cores // (world_size * workers))``."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    workers = concurrent_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    cores = available_cores() if cores is None else cores
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores!r}")
    return max(1, cores // (world_size * workers))
