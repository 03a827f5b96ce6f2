"""Launched mode: the suite runs in lockstep on the ranks of a torchrun job."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

_HAS_TORCHRUN = shutil.which("torchrun") is not None or Path(sys.executable).with_name("torchrun").exists()
pytestmark = pytest.mark.skipif(not _HAS_TORCHRUN, reason="torchrun is not installed next to this interpreter")


def _torchrun() -> str:
    local = Path(sys.executable).with_name("torchrun")
    return str(local) if local.exists() else "torchrun"


def _one_agent(tmp_path: Path, ranks: int, args: list[str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A job of one node of ``ranks`` ranks over the reference; the report alone in its folder, the job run
    elsewhere, where pytest's plugins may leave their own files (pytest-benchmark's .benchmarks)."""
    reports, work = tmp_path / "reports", tmp_path / "work"
    reports.mkdir()
    work.mkdir()
    cmd = [_torchrun(), f"--nproc-per-node={ranks}", "-m", "conformance", "run", "--rank-mode", "launched",
           "--impl", "reference", *args, "--json", str(reports / "report.json")]
    # CPU rows: on a GPU machine the job hides CUDA, as docs/USAGE.md says.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, reports


def test_exec_order_under_torchrun_writes_one_report(tmp_path: Path) -> None:
    # 3 ranks: exec_order's cases accept any world size from 2 and run at the job's ([Note: world sizes]).
    proc, reports = _one_agent(tmp_path, 3, ["-k", "exec_order"])
    rows = json.loads((reports / "report.json").read_text())["rows"]
    assert len(rows) == 8 and {r["outcome"] for r in rows} == {"pass"}
    assert {r["rank_mode"] for r in rows} == {"launched"} and {r["world_size"] for r in rows} == {3}
    assert proc.stdout.count("conformance matrix") == 1, "only rank 0 prints the matrix"
    assert sorted(p.name for p in reports.iterdir()) == ["report.json"]


# A process pool that rank 0 starts inside the job (20 to 30 s more on a loaded 2-core box): nightly
# ([Note: nightly tests]).
@pytest.mark.nightly
def test_rows_smaller_than_the_job_run_on_process_ranks_rank_0_spawns(tmp_path: Path) -> None:
    """[Note: rows smaller than the job] in harness.ranks.launched: in a 3-rank job the world-size-1 rows run on
    1 process rank and a bfloat16 reduction's row (exact at 2 ranks) on 2, every rank reporting rank 0's
    outcome; the reason says where each ran."""
    _, reports = _one_agent(tmp_path, 3, ["-k", "world_size_1 or repro_full_state_dict_mid_iteration_bf16"])
    rows = {r["case"]: r for r in json.loads((reports / "report.json").read_text())["rows"]}
    assert len(rows) == 5, sorted(rows)
    note = "spawned on node 0 (it needs world size {size} ({why}); the launched job has 3, its other ranks waited)"
    for case, row in rows.items():
        assert (row["outcome"], row["rank_mode"]) == ("pass", "launched"), row
        if case.startswith("construction/world_size_1"):
            want = "ran on 1 process rank " + note.format(size=1, why="the switch to NO_SHARD is world size 1's "
                                                                       "behaviour")
            assert (row["world_size"], row["reason"]) == (1, want), row
        else:
            want = "ran on 2 process ranks " + note.format(size=2, why="a bfloat16 reduction has one correct value "
                                                                       "at 2 ranks only")
            assert (row["world_size"], row["reason"]) == (2, want), row


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_DYING_ADAPTER = """
import os

import torch.distributed as dist

from conformance.adapters.reference import ReferenceAdapter


class DyingAdapter(ReferenceAdapter):
    \"\"\"The reference, except that the job's last rank exits in its first wrap.\"\"\"

    name = "dying"

    def wrap(self, module, spec):
        if dist.get_rank() == dist.get_world_size() - 1:
            os._exit(3)
        return super().wrap(module, spec)
"""


def _two_agents(tmp_path: Path, args: list[str], env: dict[str, str]) -> list[subprocess.Popen[str]]:
    """Two torchrun agents of 2 ranks on a c10d rendezvous: a simulated job of 2 nodes x 2 ranks. The first
    hosts the job's store, as the head node does in a cluster (on one box either agent could bind it), and
    joins first: the rendezvous numbers the nodes by process id, so it is node 0, with rank 0."""
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env}
    agents = []
    for host in (1, 0):
        cmd = [_torchrun(), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
               "--rdzv-id=two-agents", f"--rdzv-conf=is_host={host}", "-m", "conformance", "run", "--rank-mode",
               "launched", *args]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       cwd=tmp_path, env=env))
    return agents


# The launcher's plumbing, not a torch verdict: on the first torch only ([Note: tests on the first torch]).
@pytest.mark.first_torch
def test_two_agents_make_a_two_node_job(tmp_path: Path) -> None:
    """Two torchrun agents on one box, a c10d rendezvous, gloo: a simulated job of 2 nodes x 2 ranks
    ([Note: job layout] in harness.ranks.launched). The hybrid row shards within a node and replicates across the
    agents, and the report records the layout; the fuzz row runs at the job's 4 ranks."""
    report = tmp_path / "report.json"
    agents = _two_agents(tmp_path, ["--impl", "reference", "-k", "hybrid_shard and sync_module_states or "
                                    "repro_summon_grads_float64_padding_shard", "--json", str(report)], {})
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    doc = json.loads(report.read_text())
    assert doc["topology"] == {"nodes": 2, "local_world_size": 2, "world_size": 4}
    rows = {r["case"]: r for r in doc["rows"]}
    expected = ["fuzz/repro_summon_grads_float64_padding_shard", "hybrid_shard/sync_module_states"]
    assert sorted(rows) == expected, sorted(rows)
    assert {(r["outcome"], r["world_size"], r["rank_mode"]) for r in rows.values()} == {("pass", 4, "launched")}
    hybrid = rows["hybrid_shard/sync_module_states"]
    assert hybrid["metrics"] == {"mesh_replicas": 2, "mesh_shards": 2}, hybrid
    assert hybrid["reason"].startswith("mesh 2 replicas x 2 shards (shard within a node, replicate across 2 "
                                       "launched agents)"), hybrid["reason"]
    assert sum(out.count("conformance matrix") for out in outputs) == 1, "only rank 0 prints the matrix"


# The launcher's plumbing, not a torch verdict: on the first torch only ([Note: tests on the first torch]). A
# second two-node job (20 to 40 s on a 2-core box) with a lost rank: nightly ([Note: nightly tests]).
@pytest.mark.first_torch
@pytest.mark.nightly
def test_a_rank_that_dies_in_a_launched_job_is_named_in_rank_0s_report(tmp_path: Path) -> None:
    """Rank 3 (node 1, local rank 1) exits in its row: the row fails naming it as the rank that never reported,
    with its node and local rank, and the collective rank 0 was in; rank 0's report holds the row and says it
    is incomplete ([Note: job layout] in harness.ranks.launched)."""
    (tmp_path / "dying_adapter.py").write_text(_DYING_ADAPTER)
    report = tmp_path / "report.json"
    env = {"FSDP_CONFORMANCE_ADAPTERS": "dying=dying_adapter:DyingAdapter",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    agents = _two_agents(tmp_path, ["--impl", "dying", "-k", "exec_order and train_eval", "--json", str(report)],
                         env)
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert all(agent.returncode != 0 for agent in agents), "\n".join(out[-3000:] for out in outputs)
    doc = json.loads(report.read_text())
    assert not doc["complete"] and doc["topology"] == {"nodes": 2, "local_world_size": 2, "world_size": 4}
    assert len(doc["rows"]) == 1, "\n".join(out[-6000:] for out in outputs)
    (row,) = doc["rows"]
    assert row["outcome"] == "FAIL" and row["case"].startswith("exec_order/train_eval"), row
    assert re.search(r"ranks that never reported this row: (rank 2 \(node 1, local rank 0\), )?rank 3 \(node 1, "
                     r"local rank 1\);", row["reason"]), row["reason"]
    assert re.search(r"rank 0 \(node 0, local rank 0\) (waited in|had left) [a-z_]+ #\d+", row["reason"]), row["reason"]
    assert "exitcode  : 3" in "".join(outputs) or "exitcode: 3" in "".join(outputs), outputs[1][-3000:]


def test_a_launched_failure_names_each_ranks_node_and_local_rank() -> None:
    """torchrun numbers a node's ranks contiguously: with 2 ranks per node, rank 3 is node 1's local rank 1."""
    from harness.ranks.errors import RankError, make_failure
    from harness.ranks.launched import placed

    failure = make_failure([RankError(3, "raised", "AssertionError: boom"),
                            RankError(0, "aborted", "waiting in all_reduce #2 for rank 3")], world_size=4,
                           mode="launched")
    message = str(placed(failure, local_world_size=2))
    assert message.startswith("rank 3 (node 1, local rank 1) raised AssertionError: boom (world_size=4, "
                              "mode=launched)"), message
    assert "also: rank 0 (node 0, local rank 0) aborted: waiting in all_reduce #2 for rank 3" in message, message


def test_the_job_layout_is_nodes_of_local_ranks() -> None:
    from harness.ranks.launched import job_layout

    env = {"RANK": 5, "WORLD_SIZE": 8, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 4, "GROUP_RANK": 1}
    assert job_layout(env) == {"nodes": 2, "local_world_size": 4, "world_size": 8, "node": 1, "rank": 5,
                               "local_rank": 1}
    with pytest.raises(ValueError, match="WORLD_SIZE=6 is not a whole number of nodes of LOCAL_WORLD_SIZE=4 ranks"):
        job_layout({**env, "WORLD_SIZE": 6})


def test_the_ranks_thatnever_reported_a_row_are_the_ones_missing_from_the_store() -> None:
    import torch.distributed as dist

    from harness.ranks.launched import never_reported

    store = dist.HashStore()
    for rank in (0, 1, 2):
        store.set(f"row/{rank}", "1")
    assert never_reported(store, "row", world_size=4, wait_s=0.0) == [3]
    store.set("row/3", "1")
    assert never_reported(store, "row", world_size=4, wait_s=0.0) == []
