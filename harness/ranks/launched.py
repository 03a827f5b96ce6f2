"""Launched ranks: this process already is one rank of a job (e.g. started by torchrun).

[Note: launched mode]
``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` and a rendezvous (``MASTER_ADDR``/``MASTER_PORT``). Every
rank runs the same pytest session, so cases are collected in the same order
and run in lockstep: each case body runs in-process on the job's default
group, then all ranks exchange their outcomes over a separate gloo group, so
every rank reports the same result for the case (and rank 0 writes the
report). A case runs at the job's size: a plugin answers ``pytest_ranks_world_size``
with it for the rows that accept it, and with a smaller size or a skip for the
others (the conformance suite: [Note: world sizes]); a ``ranks`` test of a
smaller size that fits on one node runs on node 0 as
[Note: rows smaller than the job] says, one larger is skipped with the reason.
A rank blocked in a collective because a peer failed is released by the
backend's timeout (``timeout_s`` of the first case initialises it); the
outcomes are exchanged with a longer one, so the peers are still there.

[Note: job layout]
A launched job's ranks lie on nodes: torchrun starts one agent per node, each
with ``LOCAL_WORLD_SIZE`` ranks, and numbers the nodes ``GROUP_RANK``. The
layout is ``nodes x local ranks`` (:func:`job_layout`), what every rank's
``RankContext`` carries (``local_rank``, ``local_world_size``) and what cases
that place groups on nodes (hybrid sharding, 2-D meshes: [Note: hybrid layout]
in :mod:`fixtures.meshes`) build from, so a job shards within a node and
replicates across nodes. One box simulates several nodes with several agents
(``--nnodes=2`` with a c10d rendezvous, each agent its own ``torchrun``);
the report records the layout (``topology``). A failure names each rank's
place in it, ``rank 3 (node 1, local rank 1)``, and as for spawned ranks the
collective the waiting ranks are in ([Note: collective mismatch] in
:mod:`harness.collectives.sequence`): every rank counts its collectives in a slot and
sends its position with its outcome. A rank that dies or leaves the job
breaks the exchange: the row fails naming the ranks that never reported it
(each rank marks its report in the job's store first), and the job stops
before its next row, rank 0 writing its report.

[Note: rows smaller than the job]
A row whose size is below the job's and fits on one node (``world_size <=
LOCAL_WORLD_SIZE``: a world-size-1 behaviour, a row whose expectations hold at
one size only) runs as process ranks of its own size, spawned by rank 0 on
node 0 (:func:`run_within_node`), as ``--rank-mode process`` runs it; the
job's other ranks wait for it in the job's store, then every rank receives
rank 0's outcome in the exchange, so all report the same result. A row larger
than a node's ranks is skipped naming the layout. The spawned ranks are
process ranks: they hide CUDA under the ``cpu`` placement, so a CPU row runs
this way on a node whose launched ranks see GPUs.

Placements ([Note: placements] in :mod:`harness.ranks.devices`): the job's default
group is made once, ``cpu:gloo,cuda:nccl`` when every local rank has a GPU of
its own (it moves CPU and CUDA tensors), else ``gloo``; each case then
computes on its placement's device (``cpu``; ``cuda:{local_rank}``; a shared
GPU). Unlike a rank process, a launched rank already exists when the case
starts, so the ``cpu`` placement cannot hide CUDA from it: where the rank sees a
GPU, a CPU row is skipped with that reason (an implementation that picks its
compute device from what it sees would compute on the GPU, and the row would
test another placement than it names). A job started with
``CUDA_VISIBLE_DEVICES=`` runs the CPU rows.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.collectives.recorder import observe_thread, observing
from harness.collectives.sequence import SLOT_SIZE, Position, Slot, attributed
from harness.ranks.context import RankContext
from harness.ranks.devices import process_backend, rank_device, visible_gpus
from harness.ranks.errors import RankFailure, make_failure
from harness.ranks.outcome import Outcome, capture, resolve, skip_exception
from harness.ranks.rank_mode import RankMode
from harness.ranks.reset import case_scope

__all__ = ["run_launched", "run_within_node", "within_node", "job_env", "job_backend", "job_layout",
           "never_reported", "placed", "ENV_VARS"]

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_control: list[Any] = []
#: This rank's position in its collective sequence ([Note: collective mismatch]), made on first use.
_slot: list[Slot] = []
#: Rows exchanged so far (the store's key of each row's reports), and why the job cannot go on, once it cannot.
_reported = [0]
_lost: list[str] = []
#: How long past a smaller row's own timeout the job's other ranks wait for rank 0's spawned ranks (their start).
_SPAWN_MARGIN_S = 90.0


def job_env() -> dict[str, int]:
    """The job's rank layout from the launcher's environment; a clear error when absent."""
    missing = [name for name in ENV_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"launched mode needs {', '.join(ENV_VARS)} in the environment (missing {missing}); "
            "start the suite with torchrun, e.g. torchrun --nproc-per-node=2 -m conformance run --rank-mode launched"
        )
    env = {name: int(os.environ[name]) for name in ENV_VARS}
    env["LOCAL_WORLD_SIZE"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    env["GROUP_RANK"] = int(os.environ.get("GROUP_RANK", env["RANK"] // env["LOCAL_WORLD_SIZE"]))
    return env


def job_layout(env: dict[str, int] | None = None) -> dict[str, int]:
    """The job's ``nodes x local ranks`` ([Note: job layout]) and this rank's place in it; ValueError naming
    a ``WORLD_SIZE`` that is not a whole number of nodes of ``LOCAL_WORLD_SIZE`` ranks."""
    job = job_env() if env is None else env
    world, local = job["WORLD_SIZE"], job["LOCAL_WORLD_SIZE"]
    if local < 1 or world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a whole number of nodes of LOCAL_WORLD_SIZE={local} ranks "
                         "(nodes with different numbers of ranks are not supported)")
    return {"nodes": world // local, "local_world_size": local, "world_size": world,
            "node": job["GROUP_RANK"], "rank": job["RANK"], "local_rank": job["LOCAL_RANK"]}


def _device(placement: str, local_rank: int, gpus: int) -> torch.device:
    device = rank_device(placement, local_rank, gpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def job_backend(local_world_size: int, gpus: int, nccl: bool) -> str:
    """The launched job's default group: nccl for CUDA tensors only when every local rank has its own GPU."""
    return process_backend("cuda" if gpus >= local_world_size and nccl else "cpu")


def _ensure_initialised(timeout_s: float, job: dict[str, int], gpus: int) -> Any:
    if not dist.is_initialized():
        backend = job_backend(job["LOCAL_WORLD_SIZE"], gpus, dist.is_nccl_available())
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    if not _control:
        # Longer than the job's: a rank that left a collective early waits here for the ones it left behind
        # until the backend's timeout releases them, then hears where they were.
        _control.append(dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * timeout_s + 60)))
    return _control[0]


def run_launched(fn: Callable[..., Any], *, world_size: int, timeout_s: float, args: tuple[Any, ...],
                 kwargs: Mapping[str, Any], seed: int, env: Mapping[str, str] | None,
                 placement: str = "cpu") -> list[Any]:
    job = job_env()
    if world_size != job["WORLD_SIZE"]:
        more = f" ({_layout_text(job)}: more than a node's ranks)" if world_size < job["WORLD_SIZE"] else ""
        raise pytest.skip.Exception(f"needs world size {world_size}, the launched job has {job['WORLD_SIZE']}{more}")
    gpus = visible_gpus()
    if placement == "cpu" and gpus:
        raise pytest.skip.Exception(
            f"a CPU row, and this launched rank sees {gpus} GPU(s) it cannot hide (an implementation would pick "
            "one as its compute device); start the job with CUDA_VISIBLE_DEVICES= to run CPU rows")
    if _lost:
        pytest.exit(f"the launched job lost a rank ({_lost[0]}); its rows cannot run", returncode=1)
    control = _ensure_initialised(max(timeout_s, 60.0), job, gpus)
    device = _device(placement, job["LOCAL_RANK"], gpus)
    ctx = RankContext(rank=job["RANK"], world_size=job["WORLD_SIZE"], local_rank=job["LOCAL_RANK"],
                      local_world_size=job["LOCAL_WORLD_SIZE"], device=device,
                      backend=dist.get_backend(), mode=RankMode.LAUNCHED, seed=seed)
    outcome, position = _run_body(ctx, fn, args, kwargs, seed, env)
    exchanged = _exchange(ctx, (outcome, position), control)
    try:
        return resolve([o for o, _ in exchanged], world_size=ctx.world_size, mode=RankMode.LAUNCHED)
    except RankFailure as failure:
        raise placed(attributed(failure, {p.rank: p for _, p in exchanged}), ctx.local_world_size) from None


def within_node(world_size: int, env: dict[str, int] | None = None) -> bool:
    """Whether a row of ``world_size`` ranks runs on node 0 as spawned process ranks ([Note: rows smaller than
    the job]): it is smaller than the job and fits on one node."""
    job = job_env() if env is None else env
    return world_size < job["WORLD_SIZE"] and world_size <= job["LOCAL_WORLD_SIZE"]


def run_within_node(spawn: Callable[[], list[Any]], *, world_size: int, timeout_s: float) -> list[Any]:
    """``spawn()``'s per-rank values, run by rank 0 alone, on every rank of the job ([Note: rows smaller than
    the job]); ``spawn`` runs the row on ``world_size`` process ranks. Raises what it raised on every rank."""
    job = job_env()
    if not within_node(world_size, job):
        raise ValueError(f"world_size={world_size} does not run within a node of this job ({_layout_text(job)})")
    if _lost:
        pytest.exit(f"the launched job lost a rank ({_lost[0]}); its rows cannot run", returncode=1)
    control = _ensure_initialised(max(timeout_s, 60.0), job, visible_gpus())
    store, key = dist.distributed_c10d._get_default_store(), f"fsdp-conformance/within-node/{_reported[0] + 1}"
    if job["RANK"] == 0:
        try:
            mine = Outcome(rank=0, ok=True, value=spawn())
        except BaseException as exc:  # noqa: BLE001 - every rank raises it after the exchange
            mine = capture(0, exc)
        store.set(key, "done")
    else:
        mine = Outcome(rank=job["RANK"], ok=True)
        # The spawned ranks' timeout, their start and a margin; past it (torch's DistStoreError: rank 0 is still
        # running it, or gone) the exchange waits on, or names a lost rank 0.
        with contextlib.suppress(RuntimeError):
            store.wait([key], timedelta(seconds=timeout_s + _SPAWN_MARGIN_S))
    ctx = RankContext(rank=job["RANK"], world_size=job["WORLD_SIZE"], local_rank=job["LOCAL_RANK"],
                      local_world_size=job["LOCAL_WORLD_SIZE"], device=torch.device("cpu"),
                      backend=dist.get_backend(), mode=RankMode.LAUNCHED, seed=0)
    first: Outcome = _exchange(ctx, mine, control)[0]
    if first.ok:
        return list(first.value)
    raise _reraised(first)


def _reraised(outcome: Outcome) -> BaseException:
    """The exception rank 0's failed ``outcome`` carries: its skip, its own exception when it unpickles, else
    a RuntimeError with its text."""
    if outcome.is_skip:
        return skip_exception(outcome)
    if outcome.exc_pickle is not None:
        exc: BaseException = pickle.loads(outcome.exc_pickle)
        return exc
    return RuntimeError(f"{outcome.exc_type}: {outcome.message}")


def _layout_text(job: dict[str, int]) -> str:
    nodes = job["WORLD_SIZE"] // max(job["LOCAL_WORLD_SIZE"], 1)
    return f"{nodes} node(s) of {job['LOCAL_WORLD_SIZE']} rank(s)"


def _exchange(ctx: RankContext, mine: Any, control: Any) -> list[Any]:
    """Every rank's ``mine``: its outcome and collective position (its outcome alone for a row run on node 0).
    Each rank first says it reported in the job's store; when the exchange fails (a rank died or left the
    job), the ranks that never said so are named with where this rank was in its collectives, and the job
    stops before its next row (every collective with a lost rank would wait for the backend's timeout)."""
    _reported[0] += 1  # every rank runs the same rows in the same order
    store, key = dist.distributed_c10d._get_default_store(), f"fsdp-conformance/reported/{_reported[0]}"
    store.set(f"{key}/{ctx.rank}", "1")
    exchanged: list[Any] = [None] * ctx.world_size
    try:
        dist.all_gather_object(exchanged, mine, group=control)
    except RuntimeError as exc:  # torch's DistBackendError: a peer closed its connection or timed out
        missing = never_reported(store, key, ctx.world_size)
        where = ", ".join(f"rank {r} ({_place(r, ctx.local_world_size)})" for r in missing) or "none found"
        _lost.append(f"never reported: {where}")
        mine_at = _collective_text(mine[1]) if isinstance(mine, tuple) else "ran no collective of the row"
        raise RuntimeError(f"ranks that never reported this row: {where}; rank {ctx.rank} "
                           f"({_place(ctx.rank, ctx.local_world_size)}) {mine_at}; the exchange of outcomes failed: "
                           f"{exc}") from None
    return exchanged


def _collective_text(position: Position) -> str:
    """Where a rank is in its collective sequence, for a failure: ``waited in all_reduce #2``."""
    if not position.calls:
        return "entered no collective"
    return f"{'waited in' if position.inside else 'had left'} {position.op} #{position.calls}"


def never_reported(store: Any, key: str, world_size: int, wait_s: float = 10.0) -> list[int]:
    """The ranks whose report of this row is not in the store after up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r in range(world_size) if not store.check([f"{key}/{r}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def _run_body(ctx: RankContext, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any],
              seed: int, env: Mapping[str, str] | None) -> tuple[Outcome, Position]:
    """The body's outcome on this rank and where it left its collective sequence."""
    if not _slot:
        _slot.append(Slot(bytearray(SLOT_SIZE)))
    slot = _slot[0]
    slot.reset()
    try:
        with observing(), case_scope(seed, env):  # observing: this process's own collectives, none in flight
            observe_thread(slot)
            outcome = Outcome(rank=ctx.rank, ok=True, value=fn(ctx, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - exchanged with the other ranks
        outcome = capture(ctx.rank, exc)
    finally:
        observe_thread(None)
    return outcome, slot.position(ctx.rank)


def _place(rank: int, local_world_size: int) -> str:
    """Where ``rank`` runs ([Note: job layout]): torchrun numbers a node's ranks contiguously, so rank ``r`` is
    local rank ``r % local_world_size`` of node ``r // local_world_size``."""
    return f"node {rank // local_world_size}, local rank {rank % local_world_size}"


def placed(failure: RankFailure, local_world_size: int) -> RankFailure:
    """``failure`` with each rank's node and local rank named (:func:`_place`)."""
    errors = [replace(f, where=_place(f.rank, local_world_size)) for f in failure.failures]
    return make_failure(errors, world_size=failure.world_size, mode=failure.mode)
