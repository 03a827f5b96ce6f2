"""The forkserver imports this just before the task modules ([Note: preloaded task modules]): from here to
``harness.ranks._preload_end``, torch's CUDA probes raise :class:`CudaProbeRefused`, an ``ImportError``, so
that a module probing CUDA as it is imported is skipped by the forkserver (the rank imports it itself)
instead of initializing the driver in the process every rank is forked from."""

from __future__ import annotations

from typing import Any

import torch

#: torch's entry points to the CUDA driver that a probe goes through (``torch.cuda.is_available``,
#: ``device_count``, ``init`` and anything that initializes CUDA lazily); absent from CPU builds.
PROBES = ("_cuda_getDeviceCount", "_cuda_init")


class CudaProbeRefused(ImportError):
    """A task module probed CUDA while the forkserver imported it."""


def _refuse(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise CudaProbeRefused(f"torch._C.{name}() while the forkserver imports task modules")

    return refused


#: The real functions, put back by ``harness.ranks._preload_end``.
SAVED = {name: getattr(torch._C, name) for name in PROBES if hasattr(torch._C, name)}
for _name in SAVED:
    setattr(torch._C, _name, _refuse(_name))
