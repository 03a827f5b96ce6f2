"""Launched ranks: this process already is one rank of a job (e.g. started by torchrun).

[Note: launched mode]
``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` and a rendezvous (``MASTER_ADDR``/``MASTER_PORT``). Every
rank runs the same pytest session, so cases are collected in the same order
and run in lockstep: each case body runs in-process on the job's default
group, then all ranks exchange their outcomes over a separate gloo group, so
every rank reports the same result for the case (and rank 0 writes the
report). A case runs at the job's size: a plugin answers ``pytest_ranks_world_size``
with it for the rows that accept it and skips the others (the conformance suite:
[Note: world sizes]); a ``ranks`` test run at another size is skipped with the reason.
A rank blocked in a collective because a peer failed is released by the
backend's timeout (``timeout_s`` of the first case initialises it).

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

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.ranks.context import RankContext
from harness.ranks.devices import process_backend, rank_device, visible_gpus
from harness.ranks.outcome import Outcome, capture, resolve
from harness.ranks.rank_mode import RankMode
from harness.ranks.reset import case_scope

__all__ = ["run_launched", "job_env", "job_backend", "ENV_VARS"]

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_control: list[Any] = []


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
    return env


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
        _control.append(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    return _control[0]


def run_launched(fn: Callable[..., Any], *, world_size: int, timeout_s: float, args: tuple[Any, ...],
                 kwargs: Mapping[str, Any], seed: int, env: Mapping[str, str] | None,
                 placement: str = "cpu") -> list[Any]:
    job = job_env()
    if world_size != job["WORLD_SIZE"]:
        raise pytest.skip.Exception(f"needs world size {world_size}, the launched job has {job['WORLD_SIZE']}")
    gpus = visible_gpus()
    if placement == "cpu" and gpus:
        raise pytest.skip.Exception(
            f"a CPU row, and this launched rank sees {gpus} GPU(s) it cannot hide (an implementation would pick "
            "one as its compute device); start the job with CUDA_VISIBLE_DEVICES= to run CPU rows")
    control = _ensure_initialised(max(timeout_s, 60.0), job, gpus)
    device = _device(placement, job["LOCAL_RANK"], gpus)
    ctx = RankContext(rank=job["RANK"], world_size=job["WORLD_SIZE"], local_rank=job["LOCAL_RANK"],
                      local_world_size=job["LOCAL_WORLD_SIZE"], device=device,
                      backend=dist.get_backend(), mode=RankMode.LAUNCHED, seed=seed)
    try:
        with case_scope(seed, env):
            outcome = Outcome(rank=ctx.rank, ok=True, value=fn(ctx, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - exchanged with the other ranks below
        outcome = capture(ctx.rank, exc)
    outcomes: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(outcomes, outcome, group=control)
    return resolve(outcomes, world_size=ctx.world_size, mode=RankMode.LAUNCHED)
