"""``harness.run``: one entry point for process, thread and launched ranks."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from harness import launched, process, threads
from harness._rank_main import Task

__all__ = ["run", "MODES", "choose_backend"]

MODES = ("process", "thread", "launched")


class _Active:
    """Set while this process is a rank (thread run in progress, or a rank process)."""

    flag = False


_in_run = _Active


def choose_backend(world_size: int, backend: str | None) -> tuple[str, str]:
    """``(backend, device_type)``: nccl on cuda when every rank has a GPU, else gloo on cpu."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return ("nccl", "cuda") if gpus >= world_size and dist.is_nccl_available() else ("gloo", "cpu")
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available() and gpus >= world_size}
    if backend not in available:
        raise ValueError(f"backend must be 'gloo' or 'nccl' (or None to choose), got {backend!r}")
    if not available[backend]:
        why = f"needs {world_size} GPUs, found {gpus}" if backend == "nccl" else "not built into this torch"
        raise RuntimeError(f"backend {backend!r} is not available here: {why}")
    return backend, "cuda" if backend == "nccl" else "cpu"


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"process mode needs an importable module-level function; {fn!r} "
            f"({module}.{qualname}) cannot be imported by a rank process"
        )
    from harness._rank_main import resolve_fn

    try:
        found = resolve_fn((module, qualname))
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"process mode cannot import {module}.{qualname}: {exc}") from exc
    if getattr(found, "__wrapped__", found) is not fn and found is not fn:
        raise ValueError(f"{module}.{qualname} does not name {fn!r}; pass the module-level function itself")
    return module, qualname


def _check_picklable(what: str, value: Any) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise ValueError(f"process mode sends {what} to rank processes, but it does not pickle: {exc}") from exc


def run(
    fn: Callable[..., Any],
    *,
    world_size: int,
    mode: str = "process",
    backend: str | None = None,
    timeout_s: float = 60.0,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    isolated: bool = False,
    seed: int = 0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks; per-rank return values in rank order.

    Raises :class:`~harness.errors.RankFailure` (naming the rank, the kind and
    its traceback or stack) when a rank raises, dies or does not finish within
    ``timeout_s``; re-raises a skip that every rank raised. Bad arguments are
    rejected before anything starts.
    """
    kwargs = dict(kwargs or {})
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if _in_run.flag:
        raise RuntimeError("harness.run called from inside a rank; nested runs are not supported")
    if mode == "launched":
        return launched.run_launched(fn, world_size=world_size, timeout_s=timeout_s, args=args,
                                     kwargs=kwargs, seed=seed, env=env)
    if mode == "thread":
        if backend not in (None, "threaded"):
            raise ValueError(f"thread mode uses the threaded backend; backend={backend!r} is not supported")
        _in_run.flag = True
        try:
            return threads.run_threads(fn, world_size=world_size, timeout_s=timeout_s, args=args,
                                       kwargs=kwargs, seed=seed, env=env)
        finally:
            _in_run.flag = False
    chosen, device_type = choose_backend(world_size, backend)
    task = Task(fn_ref=_fn_ref(fn), args=tuple(args), kwargs=kwargs, seed=seed, env=dict(env or {}))
    _check_picklable("the arguments", (task.args, task.kwargs))
    pool = process.get_pool(world_size, chosen, device_type, fresh=isolated)
    try:
        result = pool.run(task, timeout_s)
    except BaseException as exc:
        if not _is_skip(exc):
            process.discard_pool(pool)
        raise
    if isolated:
        process.discard_pool(pool, graceful=True)
    return result


def _is_skip(exc: BaseException) -> bool:
    import pytest

    return isinstance(exc, pytest.skip.Exception)
