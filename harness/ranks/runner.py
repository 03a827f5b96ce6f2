"""``harness.run``: one entry point for process, thread and launched ranks (the top of the harness)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

import harness.ranks.launched as launched
import harness.ranks.process as process
import harness.ranks.thread_host as thread_host
from harness.ranks._host_main import ThreadTask
from harness.ranks._rank_main import Task
from harness.ranks._rank_state import is_rank_process
from harness.ranks.cpu_budget import intra_op_threads
from harness.ranks.devices import PLACEMENTS, check_placement, nccl_available, visible_gpus
from harness.ranks.main_guard import check_main_guard
from harness.ranks.rank_mode import RankMode

__all__ = ["run", "shutdown_pools"]


def _fn_ref(fn: Callable[..., Any], mode: RankMode) -> tuple[str, str]:
    """``(module, qualname)`` a rank process or thread host imports ``fn`` by; a clear error if it cannot."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{mode} mode needs an importable module-level function; {fn!r} "
            f"({module}.{qualname}) cannot be imported by a rank process or thread host"
        )
    from harness.ranks._rank_main import resolve_fn

    try:
        found = resolve_fn((module, qualname))
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{mode} mode cannot import {module}.{qualname}: {exc}") from exc
    if getattr(found, "__wrapped__", found) is not fn and found is not fn:
        raise ValueError(f"{module}.{qualname} does not name {fn!r}; pass the module-level function itself")
    return module, qualname


def _check_picklable(what: str, value: Any, mode: RankMode) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise ValueError(f"{mode} mode sends {what} to another process, but it does not pickle: {exc}") from exc


def run(
    fn: Callable[..., Any],
    *,
    world_size: int,
    mode: RankMode | str = RankMode.PROCESS,
    placement: str = "cpu",
    timeout_s: float = 60.0,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    isolated: bool = False,
    seed: int = 0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks; per-rank values in rank order.

    ``placement`` says where the ranks compute ([Note: placements] in
    :mod:`harness.ranks.devices`); the default ``cpu`` hides CUDA from them. Raises
    :class:`~harness.ranks.errors.RankFailure` (naming the rank, the kind and its
    traceback or stack) when a rank raises, dies or does not finish within
    ``timeout_s``; re-raises a skip that every rank raised. Bad arguments are
    rejected before anything starts. Launched ranks run a ``world_size`` smaller
    than their job's on process ranks that rank 0 spawns, when it fits on one
    node ([Note: rows smaller than the job] in :mod:`harness.ranks.launched`).
    """
    kwargs = dict(kwargs or {})
    mode = _check_arguments(world_size, mode, placement, timeout_s)
    if mode is RankMode.LAUNCHED and launched.within_node(world_size):  # [Note: rows smaller than the job]
        return launched.run_within_node(
            lambda: _spawned(fn, world_size, RankMode.PROCESS, placement, timeout_s, args, kwargs, isolated, seed,
                             env), world_size=world_size, timeout_s=timeout_s)
    if mode is RankMode.LAUNCHED:
        return launched.run_launched(fn, world_size=world_size, timeout_s=timeout_s, args=args,
                                     kwargs=kwargs, seed=seed, env=env, placement=placement)
    return _spawned(fn, world_size, mode, placement, timeout_s, args, kwargs, isolated, seed, env)


def _spawned(fn: Callable[..., Any], world_size: int, mode: RankMode, placement: str, timeout_s: float,
             args: tuple[Any, ...], kwargs: dict[str, Any], isolated: bool, seed: int,
             env: Mapping[str, str] | None) -> list[Any]:
    """:func:`run` on rank processes or threads this process starts."""
    check_main_guard(process.start_method())  # [Note: main-module guard]
    gpus = visible_gpus() if placement != "cpu" else 0
    check_placement(placement, world_size, gpus, nccl_available())
    task = Task(fn_ref=_fn_ref(fn, mode), args=tuple(args), kwargs=kwargs, seed=seed, env=dict(env or {}))
    _check_picklable("the arguments", (task.args, task.kwargs), mode)
    if mode is RankMode.THREAD:
        job = ThreadTask(task=task, world_size=world_size, timeout_s=timeout_s,
                         intra_op_threads=intra_op_threads(world_size))
        return thread_host.run_in_host(job, placement, gpus)
    pool = process.get_pool(world_size, placement, gpus, fresh=isolated)
    try:
        result = pool.run(task, timeout_s)
    except BaseException as exc:
        if not _is_skip(exc):
            process.discard_pool(pool)
        raise
    if isolated:
        process.discard_pool(pool, graceful=True)
    return result


def _check_arguments(world_size: int, mode: RankMode | str, placement: str, timeout_s: float) -> RankMode:
    """The rank mode ``mode`` names; ValueError naming a bad argument."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    try:
        rank_mode = RankMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {', '.join(m.value for m in RankMode)}, got {mode!r}") from None
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if is_rank_process():
        raise RuntimeError("harness.run called from inside a rank; nested runs are not supported")
    return rank_mode


def shutdown_pools() -> None:
    """Stop every rank-process pool and thread host (also at interpreter exit and at the end of a pytest session)."""
    process.shutdown_pools()
    thread_host.shutdown_hosts()


def _is_skip(exc: BaseException) -> bool:
    import pytest

    return isinstance(exc, pytest.skip.Exception)
