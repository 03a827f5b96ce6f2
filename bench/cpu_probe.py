"""CPU-seconds per conformance row: a pytest plugin that :mod:`bench.suite_time` loads into its runs.

[Note: CPU per row]
A row's wall time says little on a shared machine: it grows with the load
around it. Its CPU time does not, so this is what the cost work measures. A
row's ranks run in processes that descend from the pytest process running the
row (the rank pool's forkserver and the processes it forks, or the thread
host), so the row's CPU time is the growth, over the row, of the summed
user + system time of that process tree: each live process's own time, plus
the time of the children each has reaped (a rank process that exits moves its
time into its parent's account, so nothing is counted twice or lost). Under
``-n N`` each xdist worker measures its own tree, so rows on two workers do
not see each other's work. The first row of a process also pays for starting
its rank pool (the forkserver's imports); :mod:`bench.suite_time` reports the
rows as measured. Linux only (``/proc``).

Enabled by :data:`ENV_VAR` naming a file, to which each row appends one JSON
line: ``{"case", "impl", "rank_mode", "cpu_s"}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path

import pytest

from conformance.contract.rows import all_params, case_row_id, case_spec
from harness.environment import BENCH_CPU_LOG_ENV

__all__ = ["ENV_VAR", "tree_cpu_s"]

ENV_VAR = BENCH_CPU_LOG_ENV

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _stat_fields(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # exited since the listing
        return None
    return text.rpartition(")")[2].split()  # after the command name, which may hold spaces


def tree_cpu_s(root: int) -> float:
    """User + system CPU-seconds of ``root`` and its live descendants, with the children each has reaped."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(name)
        if fields is None:
            continue
        # fields[1] ppid; [11] utime, [12] stime, [13] cutime, [14] cstime (proc(5), counted from state)
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = sum(int(v) for v in fields[11:15])
    children: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        children.setdefault(ppid, []).append(child)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total * _TICK_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    log = os.environ.get(ENV_VAR)
    if not log or case_spec(item) is None:
        yield
        return
    start = tree_cpu_s(os.getpid())
    yield
    params = all_params(item)
    line = {"case": case_row_id(item), "impl": getattr(params.get("impl"), "name", "?"),
            "rank_mode": str(params.get("rank_mode")), "cpu_s": round(tree_cpu_s(os.getpid()) - start, 3)}
    with open(log, "a") as f:  # one short append per row: whole lines even with several workers
        f.write(json.dumps(line) + "\n")
