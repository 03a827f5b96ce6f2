"""The body of a pooled rank process: set up once, then run tasks until told to stop.

Kept separate from :mod:`harness.process` (the parent side) so the child
imports as little as possible before its process group exists.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Task", "RankSetup", "rank_main", "resolve_fn"]


@dataclass
class Task:
    """One case for one rank. ``fn_ref`` is ``(module, qualname)``."""

    fn_ref: tuple[str, str]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    seed: int
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RankSetup:
    rank: int
    world_size: int
    backend: str
    device_type: str
    store_path: str
    sys_path: list[str]
    parent_pid: int
    stack_path: str
    crash_path: str


def resolve_fn(fn_ref: tuple[str, str]) -> Any:
    module_name, qualname = fn_ref
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone (e.g. SIGKILLed), so no rank outlives its run."""
    while True:
        try:
            os.kill(parent_pid, 0)  # the parent may not be our direct parent (forkserver)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(0.5)


def _setup(setup: RankSetup) -> Any:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns teardown
    for path in reversed(setup.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.update(
        RANK=str(setup.rank),
        LOCAL_RANK=str(setup.rank),
        WORLD_SIZE=str(setup.world_size),
        LOCAL_WORLD_SIZE=str(setup.world_size),
    )
    crash = open(setup.crash_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.enable(file=crash, all_threads=True)
    stacks = open(setup.stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    threading.Thread(target=_watch_parent, args=(setup.parent_pid,), daemon=True).start()

    import torch
    import torch.distributed as dist

    from harness import runner

    runner._in_run.flag = True  # a rank process never starts ranks of its own
    if setup.device_type == "cuda":
        torch.cuda.set_device(setup.rank)
        device = torch.device("cuda", setup.rank)
    else:
        device = torch.device("cpu")
    store = dist.FileStore(setup.store_path, setup.world_size)
    dist.init_process_group(setup.backend, store=store, rank=setup.rank, world_size=setup.world_size)
    return device


def _run(setup: RankSetup, device: Any, task: Task) -> Any:
    from harness.context import RankContext
    from harness.outcome import Outcome, capture
    from harness.reset import case_scope

    ctx = RankContext(
        rank=setup.rank,
        world_size=setup.world_size,
        local_rank=setup.rank,
        local_world_size=setup.world_size,
        device=device,
        backend=setup.backend,
        mode="process",
        seed=task.seed,
    )
    try:
        with case_scope(task.seed, task.env):
            value = resolve_fn(task.fn_ref)(ctx, *task.args, **task.kwargs)
        return Outcome(rank=setup.rank, ok=True, value=value)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        return capture(setup.rank, exc)


def rank_main(setup: RankSetup, conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    device = _setup(setup)
    from harness.outcome import capture

    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break
        if task is None:
            break
        outcome = _run(setup, device, task)
        try:
            conn.send(outcome)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(capture(setup.rank, TypeError(f"rank {setup.rank} returned an unpicklable value: {exc}")))
    import torch.distributed as dist

    dist.destroy_process_group()
