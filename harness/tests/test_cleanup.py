"""Nothing outlives a run: processes, threads, temporary directories; pools never collide."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

import harness
from harness.tests.test_faults import _exit_on_rank_1, _raise_on_rank_1

FAULTY = [_raise_on_rank_1, _exit_on_rank_1]


def _children() -> set[int]:
    """Live child processes of this process, from /proc (no psutil needed)."""
    mine = str(os.getpid())
    found = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == mine and fields[0] != "Z":
            found.add(int(stat.split("/")[2]))
    return found


def _multiprocessing_helpers() -> set[int]:
    """multiprocessing's own long-lived helpers (forkserver, resource tracker): not ranks.

    Each is started once per parent process and exits with it.
    """
    from multiprocessing import forkserver, resource_tracker

    pids = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}  # type: ignore[attr-defined]
    return {pid for pid in pids if pid is not None}


def _harness_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "fsdp-harness-*")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_fifty_faulted_runs_leave_nothing_behind() -> None:
    harness.shutdown_pools()
    dirs_before, threads_before = _harness_dirs(), threading.active_count()
    children_before = _children()
    for i in range(50):
        mode = "process" if i % 2 == 0 else "thread"
        with pytest.raises(harness.RankFailure):
            harness.run(FAULTY[(i // 2) % 2] if mode == "process" else _raise_on_rank_1,
                        world_size=2, mode=mode, timeout_s=30)
    harness.shutdown_pools()
    assert _children() - children_before - _multiprocessing_helpers() == set(), "rank processes outlived their run"
    assert _harness_dirs() - dirs_before == set(), "temporary directories were left behind"
    assert threading.active_count() == threads_before, "rank threads outlived their run"


def test_two_suites_at_once_do_not_collide(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import harness, torch, torch.distributed as dist
        from harness.tests.test_run import _sum_of_ranks
        for _ in range(20):
            assert harness.run(_sum_of_ranks, world_size=2)[1][2] == 3.0
        print("ok")
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=os.getcwd()) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0 and out.strip() == "ok", err[-2000:]
