"""``RankContext``: what a rank's body receives as ``ctx``."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import harness.ranks.warnings_capture as warnings_capture
from harness.ranks.kept_groups import kept
from harness.ranks.rank_mode import RankMode

__all__ = ["RankContext"]

#: Serialises global-RNG use across thread ranks (see :meth:`RankContext.rng`).
_RNG_LOCK = threading.RLock()


@dataclass
class RankContext:
    """One rank's view of the run.

    ``device`` is what the run's placement gives this rank ([Note: placements]
    in :mod:`harness.ranks.devices`): the CPU, ``cuda:{rank}``, or a shared GPU. Collective helpers
    must be called by every rank, like the collectives they wrap.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    mode: RankMode
    seed: int

    @property
    def group(self) -> dist.ProcessGroup:
        """The default (world) process group."""
        return dist.distributed_c10d._get_default_group()

    def barrier(self) -> None:
        dist.barrier()

    def new_group(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """A subgroup; every rank must call this with the same ``ranks`` in the same order. Process ranks keep
        it for later cases ([Note: kept groups] in :mod:`harness.ranks.kept_groups`)."""
        members = list(ranks)
        if self.mode is not RankMode.PROCESS:  # see [Note: kept groups]
            return dist.new_group(members)
        return kept(("group", tuple(members)), lambda: dist.new_group(members))

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_ranks_equal(self, obj: Any) -> bool:
        """Whether every rank passed an equal (``==``) object."""
        values = self.all_gather_object(obj)
        return all(v == values[0] for v in values[1:])

    def device_mesh(self, shape: Sequence[int], mesh_dim_names: Sequence[str] | None = None) -> Any:
        """A DeviceMesh over the whole world on this run's device type; process ranks keep it (and its groups)
        for later cases ([Note: kept groups] in :mod:`harness.ranks.kept_groups`)."""
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        dims, kind = tuple(shape), self.device.type
        if self.mode is not RankMode.PROCESS:  # see [Note: kept groups]
            return init_device_mesh(kind, dims, mesh_dim_names=names)
        return kept(("mesh", kind, dims, names), lambda: init_device_mesh(kind, dims, mesh_dim_names=names))

    def catch_warnings(self) -> AbstractContextManager[list[Any]]:
        """Warnings raised on this rank only, every occurrence (see [Note: per-rank warnings])."""
        return warnings_capture.capture()

    @contextmanager
    def rng(self, seed: int) -> Iterator[None]:
        """Deterministic use of the global torch/python RNG inside the block.

        Thread ranks share one global RNG, so the block holds a process-wide
        lock and reseeds on entry; two ranks' blocks never interleave.
        """
        with _RNG_LOCK:
            torch.manual_seed(seed)
            random.seed(seed)
            yield

    def record_collectives(self, **kwargs: Any) -> Any:
        """Record (and optionally delay or fail) this rank's collectives; see :mod:`harness.collectives.recorder`."""
        from harness.collectives.recorder import record

        return record(self, **kwargs)
