"""Multi-rank helpers for fsdp_impl's tests.

``spawn_ranks`` runs a module-level ``fn(rank, world_size, *args)`` on N gloo
processes rendezvousing through a ``FileStore``; each test batches several
configurations into one spawn to keep process start-up off the critical path.
``ws1`` gives the test process itself a one-rank gloo group.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, env: dict[str, str], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(env)
    dist.set_debug_level_from_env()  # torch reads TORCH_DISTRIBUTED_DEBUG at import
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def spawn_ranks(tmp_path: Any) -> Callable[..., None]:
    counter = iter(range(1000))

    def run(fn: Callable[..., Any], world_size: int, *args: Any, env: dict[str, str] | None = None) -> None:
        store = str(tmp_path / f"store{next(counter)}")
        mp.spawn(_worker, args=(world_size, store, env or {}, fn, args), nprocs=world_size, join=True)

    return run


@pytest.fixture
def ws1() -> Generator[None, None, None]:
    """A one-rank default group in the test process (created once, kept)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
