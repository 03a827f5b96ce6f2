"""Launched mode: the suite runs in lockstep on the ranks of a torchrun job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_HAS_TORCHRUN = shutil.which("torchrun") is not None or Path(sys.executable).with_name("torchrun").exists()
pytestmark = pytest.mark.skipif(not _HAS_TORCHRUN, reason="torchrun is not installed next to this interpreter")


def _torchrun() -> str:
    local = Path(sys.executable).with_name("torchrun")
    return str(local) if local.exists() else "torchrun"


def test_exec_order_under_torchrun_writes_one_report(tmp_path: Path) -> None:
    # The report alone in its folder; the job runs elsewhere, where pytest's plugins may leave their own files
    # (pytest-benchmark's .benchmarks).
    reports, work = tmp_path / "reports", tmp_path / "work"
    reports.mkdir()
    work.mkdir()
    report = reports / "report.json"
    # 3 ranks: exec_order's cases accept any world size from 2 and run at the job's; the world-size-1 case
    # is skipped naming its requirement ([Note: world sizes]).
    cmd = [_torchrun(), "--nproc-per-node=3", "-m", "conformance", "run", "--rank-mode", "launched",
           "--impl", "reference", "-k", "exec_order or world_size_1", "--json", str(report)]
    # CPU rows: on a GPU machine the job hides CUDA, as docs/USAGE.md says.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    every = json.loads(report.read_text())["rows"]
    rows = [r for r in every if r["case"].startswith("exec_order/")]
    assert len(rows) == 8 and {r["outcome"] for r in rows} == {"pass"}
    assert {r["rank_mode"] for r in rows} == {"launched"} and {r["world_size"] for r in rows} == {3}
    skipped = {(r["outcome"], r["reason"]) for r in every if r not in rows}
    assert skipped == {("skip", "needs world size 1 (the switch to NO_SHARD is world size 1's behaviour), the "
                                "launched job has 3")}, skipped
    assert proc.stdout.count("conformance matrix") == 1, "only rank 0 prints the matrix"
    assert sorted(p.name for p in reports.iterdir()) == ["report.json"]


def test_launched_mode_outside_a_job_explains_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.ranks.launched import job_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="launched mode needs RANK, WORLD_SIZE, LOCAL_RANK"):
        job_env()


def test_a_launched_rank_that_sees_a_gpu_skips_cpu_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """It cannot hide the GPU from the implementation, so the row would test another placement than it names."""
    import harness.ranks.launched as launched

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launched, "visible_gpus", lambda: 1)
    never = {"called": False}
    monkeypatch.setattr(launched, "_ensure_initialised", lambda *a: never.update(called=True))
    with pytest.raises(pytest.skip.Exception, match=r"sees 1 GPU\(s\) it cannot hide .* CUDA_VISIBLE_DEVICES="):
        launched.run_launched(lambda ctx: None, world_size=2, timeout_s=5, args=(), kwargs={}, seed=0, env=None,
                              placement="cpu")
    assert not never["called"], "skipped before the job's group is made"
