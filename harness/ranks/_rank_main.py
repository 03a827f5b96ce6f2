"""The body of a pooled rank process: set up once, then run tasks until told to stop.

Kept separate from :mod:`harness.ranks.process` (the parent side) so the child
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

from harness.ranks._rank_state import mark_rank_process
from harness.ranks.devices import hide_cuda, process_backend, rank_device
from harness.ranks.rank_mode import RankMode

__all__ = ["Task", "RankSetup", "rank_main", "resolve_fn", "prepare_child", "apply_placement"]


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
    """What a rank process needs to join its pool (see [Note: placements] in :mod:`harness.ranks.devices`)."""

    rank: int
    world_size: int
    placement: str
    gpus: int
    #: torch intra-op threads for this rank ([Note: intra-op threads] in :mod:`harness.ranks.cpu_budget`).
    intra_op_threads: int
    store_path: str
    sys_path: list[str]
    parent_pid: int
    stack_path: str
    crash_path: str
    #: This rank's collective position, read by the parent
    #: ([Note: collective mismatch] in harness.collectives.sequence).
    slot_path: str = ""


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


def prepare_child(sys_path: list[str], parent_pid: int, crash_path: str, stack_path: str) -> None:
    """What every harness child does first: parent's import path, crash/stack dumps, a parent watchdog."""
    # The parent owns teardown: a stop signal sent to the whole process group (Ctrl-C, a CI's SIGTERM, a
    # closed terminal's SIGHUP) must not kill a rank mid-case, which would read as that rank's death; the
    # parent stops its ranks as it winds down, and the watchdog below ends them if the parent is gone.
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    for path in reversed(sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    crash = open(crash_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.enable(file=crash, all_threads=True)
    stacks = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    mark_rank_process()  # a rank process never starts ranks of its own


def freeze_imports() -> None:
    """Leave what the process has imported out of every later cycle collection.

    [Note: frozen imports]
    A rank process holds about 280,000 objects once torch, ``torch.distributed``
    and ``torch._dynamo`` are imported, and a full cycle collection walks them
    all: 0.5 to 0.8 s on the loaded 2-core box, paid at every ``gc.collect()`` a case or
    the stateful fuzzer makes (a dropped model's check, a memory count over its
    bound) and at every automatic full collection. Objects made by imports live as
    long as the process, so after the imports ``gc.freeze()`` moves them to the
    permanent generation the collector skips; a collection then takes about 0.01 s.
    Everything made after it (a case's models, tensors, groups) is collected as
    before, and what a frozen object refers to is reachable, as it is unfrozen."""
    import gc

    gc.freeze()


def apply_placement(placement: str) -> None:
    """Hide CUDA under the ``cpu`` placement, before anything in this process touches it."""
    if placement == "cpu":
        hide_cuda()


def _setup(setup: RankSetup) -> Any:
    prepare_child(setup.sys_path, setup.parent_pid, setup.crash_path, setup.stack_path)
    os.environ.update(
        RANK=str(setup.rank),
        LOCAL_RANK=str(setup.rank),
        WORLD_SIZE=str(setup.world_size),
        LOCAL_WORLD_SIZE=str(setup.world_size),
    )
    apply_placement(setup.placement)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(setup.intra_op_threads)
    device = rank_device(setup.placement, setup.rank, setup.gpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(setup.store_path, setup.world_size)
    dist.init_process_group(process_backend(setup.placement), store=store, rank=setup.rank,
                            world_size=setup.world_size)
    freeze_imports()  # [Note: frozen imports]
    return device


def _run(setup: RankSetup, device: Any, task: Task, slot: Any) -> Any:
    from harness.ranks.context import RankContext
    from harness.ranks.outcome import Outcome, capture
    from harness.ranks.reset import case_scope

    ctx = RankContext(
        rank=setup.rank,
        world_size=setup.world_size,
        local_rank=setup.rank,
        local_world_size=setup.world_size,
        device=device,
        backend=process_backend(setup.placement),
        mode=RankMode.PROCESS,
        seed=task.seed,
    )
    if slot is not None:
        slot.reset()
    try:
        with case_scope(task.seed, task.env):
            value = resolve_fn(task.fn_ref)(ctx, *task.args, **task.kwargs)
        return Outcome(rank=setup.rank, ok=True, value=value)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        return capture(setup.rank, exc)


def rank_main(setup: RankSetup, conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    device = _setup(setup)
    from harness.collectives.recorder import observe_thread, observing
    from harness.collectives.sequence import map_slot_file
    from harness.ranks.outcome import capture

    slot = map_slot_file(setup.slot_path) if setup.slot_path else None
    with observing():  # before the first task: no rank is in a collective yet
        observe_thread(slot)
        while True:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                break
            if task is None:
                break
            outcome = _run(setup, device, task, slot)
            try:
                conn.send(outcome)
            except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
                conn.send(capture(setup.rank, TypeError(f"rank {setup.rank} returned an unpicklable value: {exc}")))
    import torch.distributed as dist

    dist.destroy_process_group()
