"""Nothing outlives a run: processes, threads, temporary directories; pools never collide."""

from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

import harness
from harness.tests.ranks.test_faults import _exit_on_rank_1, _raise_on_rank_1

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
    """Pool directories of this process (other suites may be running on the machine)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"fsdp-harness-{os.getpid()}-*")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("runs", [4, pytest.param(50, marks=pytest.mark.nightly)])  # [Note: nightly tests]
def test_faulted_runs_leave_nothing_behind(runs: int) -> None:
    """Runs that fail (a rank raising or exiting, process and thread ranks in turn) leave no process, thread or
    directory behind: four in every run of the tests (each kind of fault in each mode), fifty in a row nightly."""
    harness.shutdown_pools()
    dirs_before, threads_before = _harness_dirs(), threading.active_count()
    children_before = _children()
    for i in range(runs):
        mode = "process" if i % 2 == 0 else "thread"
        with pytest.raises(harness.RankFailure):
            harness.run(FAULTY[(i // 2) % 2] if mode == "process" else _raise_on_rank_1,
                        world_size=2, mode=mode, timeout_s=30)
    harness.shutdown_pools()
    assert _children() - children_before - _multiprocessing_helpers() == set(), "rank processes outlived their run"
    assert _harness_dirs() - dirs_before == set(), "temporary directories were left behind"
    assert threading.active_count() == threads_before, "rank threads outlived their run"


@pytest.mark.first_torch  # process lifetimes and temp dirs: [Note: tests on the first torch]
def test_two_suites_at_once_do_not_collide(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import harness, torch, torch.distributed as dist
        from harness.tests.ranks.test_run import _sum_of_ranks
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


_PARENT = """
import threading, time
import harness
from harness.ranks import process
from harness.tests.ranks.test_cleanup import hang_forever

def announce():
    while not process._pools:
        time.sleep(0.05)
    print("pids", *next(iter(process._pools.values())).pids, flush=True)

threading.Thread(target=announce, daemon=True).start()
try:
    harness.run(hang_forever, world_size=2, timeout_s=60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def hang_forever(ctx: harness.RankContext) -> None:
    while True:
        time.sleep(0.1)


def _rank_pids(proc: subprocess.Popen[str], within_s: float = 60.0) -> list[int]:
    assert proc.stdout is not None
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("pids "):
                return [int(pid) for pid in line.split()[1:]]
            if not line:
                break
    raise AssertionError(f"the parent never reported its pool: {proc.stderr.read() if proc.poll() is not None else ''}")


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.first_torch  # process lifetimes and temp dirs: [Note: tests on the first torch]
@pytest.mark.parametrize("how", ["ctrl_c", "sigkill"])
def test_ranks_do_not_outlive_an_interrupted_or_killed_parent(how: str) -> None:
    proc = subprocess.Popen([sys.executable, "-u", "-c", _PARENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=os.getcwd())
    try:
        pids = _rank_pids(proc)
        proc.send_signal(signal.SIGINT if how == "ctrl_c" else signal.SIGKILL)
        proc.wait(timeout=30)
        # Ctrl-C: the parent tears the pool down; SIGKILL: each rank's parent watchdog notices.
        assert _gone(pids, within_s=10.0), f"ranks {pids} outlived the parent ({how})"
    finally:
        proc.kill()
