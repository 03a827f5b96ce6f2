"""The device plan: which devices a run's ranks compute on, decided before the run starts.

[Note: placements]
Every run has one *placement*:

- ``cpu``: ranks compute on the CPU over gloo (thread ranks: the threaded
  group), and CUDA is hidden from them (``CUDA_VISIBLE_DEVICES`` is emptied in
  the rank process or thread host before anything touches CUDA), so an
  implementation that picks its compute device from what it can see sees a
  CPU-only world whatever the host has.
- ``cuda``: one GPU per rank, rank ``r`` on ``cuda:r``; process ranks get a
  group that moves CUDA tensors over nccl and CPU tensors over gloo
  (``cpu:gloo,cuda:nccl``), world size 1 included.
- ``cuda-shared``: fewer GPUs than ranks; rank ``r`` computes on
  ``cuda:{r % gpus}`` over gloo with CUDA tensors (nccl refuses two ranks on
  one GPU), so GPU code paths still run on a one-GPU machine.

[Note: device setting]
The user's setting is ``auto``, ``cpu`` or ``cuda``. A CPU row always runs
under ``cpu``, so its result never depends on the host. A GPU row (one that
declares a :class:`GpuNeed`) runs under ``cuda`` when there is a GPU per rank,
else under ``cuda-shared`` when it can share GPUs, else it is skipped with the
reason. ``cpu`` skips GPU rows; ``cuda`` is ``auto`` for a job that must have
a GPU (:func:`check_setting` rejects it on a machine without one).

This module decides; :mod:`harness.ranks._rank_main` and :mod:`harness.ranks.thread_host`
apply the decision inside the ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = [
    "PLACEMENTS",
    "SETTINGS",
    "GpuNeed",
    "ANY_GPU",
    "distinct_gpus",
    "Decision",
    "decide",
    "check_setting",
    "check_placement",
    "visible_gpus",
    "nccl_available",
    "process_backend",
    "rank_device",
    "hide_cuda",
]

PLACEMENTS = ("cpu", "cuda", "cuda-shared")
SETTINGS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class GpuNeed:
    """What a GPU row needs: ``distinct`` different GPUs (1: any GPU, ranks may share it)."""

    distinct: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.distinct, int) or self.distinct < 1:
            raise ValueError(f"GpuNeed.distinct must be an int >= 1, got {self.distinct!r}")

    def describe(self) -> str:
        return "any GPU" if self.distinct == 1 else f"{self.distinct} distinct GPUs"


#: A GPU row that runs on a shared GPU too.
ANY_GPU = GpuNeed(1)


def distinct_gpus(count: int) -> GpuNeed:
    """A GPU row that needs ``count`` different GPUs (e.g. one per rank)."""
    return GpuNeed(count)


@dataclass(frozen=True)
class Decision:
    """A plan for one run: the placement, or ``None`` and why it cannot run here."""

    placement: str | None
    reason: str = ""


def decide(*, setting: str, gpus: int, world_size: int, need: GpuNeed | None,
           nccl: bool = True) -> Decision:
    """Where a row runs, from the setting, the GPUs visible, its world size and its need.

    ``need=None`` is a CPU row. ``nccl=False`` (a torch without nccl) rules
    out ``cuda``, which needs nccl for CUDA tensors.
    """
    if setting not in SETTINGS:
        raise ValueError(f"device setting must be one of {SETTINGS}, got {setting!r}")
    if not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be an int >= 0, got {gpus!r}")
    if need is None:
        return Decision("cpu")
    if setting == "cpu":
        return Decision(None, f"needs {need.describe()}; the device setting is cpu")
    if gpus < need.distinct:
        return Decision(None, f"needs {need.describe()}, found {gpus}")
    if gpus >= world_size and nccl:
        return Decision("cuda")
    return Decision("cuda-shared")


def check_setting(setting: str, source: str, gpus: int) -> None:
    """Reject a bad device setting, naming where it came from (e.g. ``--fsdp-device`` or ``FSDP_DEVICE``)."""
    if setting not in SETTINGS:
        raise ValueError(f"{source}={setting!r}: expected one of {', '.join(SETTINGS)}")
    if setting == "cuda" and gpus == 0:
        raise ValueError(f"{source}=cuda, but no CUDA device is visible")


def check_placement(placement: str, world_size: int, gpus: int, nccl: bool) -> None:
    """Reject a placement this machine cannot give ``world_size`` ranks, naming what is missing."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "cuda" and (gpus < world_size or not nccl):
        why = f"found {gpus} GPUs" if gpus < world_size else "this torch has no nccl"
        raise RuntimeError(f"placement 'cuda' needs one GPU per rank ({world_size}) and nccl: {why}")
    if placement == "cuda-shared" and gpus == 0:
        raise RuntimeError("placement 'cuda-shared' needs at least one GPU, found 0")


def visible_gpus() -> int:
    """CUDA devices this process can see (0 without a CUDA build or driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_available() -> bool:
    """Whether this torch can make nccl groups (the ``cuda`` placement needs them)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


def process_backend(placement: str) -> str:
    """The default group's backend for process ranks under ``placement``."""
    return "cpu:gloo,cuda:nccl" if placement == "cuda" else "gloo"


def rank_device(placement: str, rank: int, gpus: int) -> torch.device:
    """The device ``rank`` computes on under ``placement`` with ``gpus`` GPUs visible."""
    if placement == "cpu":
        return torch.device("cpu")
    if gpus < 1:
        raise ValueError(f"placement {placement!r} needs a GPU, got gpus={gpus}")
    return torch.device("cuda", rank % gpus if placement == "cuda-shared" else rank)


def hide_cuda() -> None:
    """Make this process CPU-only before anything touches CUDA; fail loudly when that is too late.

    Called first thing in a rank process or thread host under the ``cpu``
    placement. CUDA's device count is read once per process, so hiding works
    only if nothing probed CUDA before (e.g. the forkserver that forked us).
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():
        raise RuntimeError(
            "placement 'cpu': CUDA was probed in this process before the ranks could hide it "
            f"(torch.cuda.is_initialized()={torch.cuda.is_initialized()}); ranks would still see a GPU"
        )
