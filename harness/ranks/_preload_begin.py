"""The forkserver imports this just before the task modules ([Note: preloaded task modules]). From here to
``harness.ranks._preload_end``:

- torch's CUDA probes raise :class:`CudaProbeRefused`, so a module probing CUDA as it is imported is skipped
  by the forkserver (the rank imports it itself) instead of initializing the driver in the process every
  rank is forked from;
- a task module whose import raises anything else raises :class:`TaskModuleFailed` instead: the forkserver
  skips a module that raises an ``ImportError`` but dies of any other exception, which would end every
  rank process start after it.

Both are ``ImportError``s; the rank then imports the module itself and reports what goes wrong there."""

from __future__ import annotations

import builtins
from typing import Any

import torch

#: torch's entry points to the CUDA driver that a probe goes through (``torch.cuda.is_available``,
#: ``device_count``, ``init`` and anything that initializes CUDA lazily); absent from CPU builds.
PROBES = ("_cuda_getDeviceCount", "_cuda_init")


class CudaProbeRefused(ImportError):
    """A task module probed CUDA while the forkserver imported it."""


class TaskModuleFailed(ImportError):
    """A task module's import raised something other than an ``ImportError`` in the forkserver."""


def _refuse(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise CudaProbeRefused(f"torch._C.{name}() while the forkserver imports task modules")

    return refused


REAL_IMPORT = builtins.__import__
_depth = 0  # the forkserver imports on one thread: depth 1 is its own call for a task module


def _import(name: str, *args: Any, **kwargs: Any) -> Any:
    """``__import__``, whose outermost call turns a failure other than an ``ImportError`` into one."""
    global _depth
    _depth += 1
    try:
        return REAL_IMPORT(name, *args, **kwargs)
    except ImportError:
        raise
    except Exception as exc:
        if _depth == 1:
            raise TaskModuleFailed(f"importing {name} in the forkserver raised {type(exc).__name__}: {exc}") from exc
        raise
    finally:
        _depth -= 1


#: The real functions, put back by ``harness.ranks._preload_end``.
SAVED = {name: getattr(torch._C, name) for name in PROBES if hasattr(torch._C, name)}
for _name in SAVED:
    setattr(torch._C, _name, _refuse(_name))
builtins.__import__ = _import
