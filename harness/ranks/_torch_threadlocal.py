"""The one place the harness touches torch's internal threaded process group.

torch ships ``torch.testing._internal.distributed.multi_threaded_pg``: a
``ProcessGroup`` whose ranks are threads of one process (backend name
``"threaded"``), plus a thread-local replacement for c10d's global world so
each thread has its own default group. It is internal API, so everything the
harness relies on is used only through this module and pinned by
``harness/tests/ranks/test_torch_threadlocal.py``:

- ``install()`` swaps in the thread-local world, makes c10d's group-name
  registry per thread (ranks register the same names) and turns autograd's
  multithreading off (backward must run on the rank's own thread);
  ``uninstall()`` undoes both.
- Its groups report the device type the ranks compute on (``group._device_types``,
  ``cpu`` or ``cuda``). The threaded group is a bare ``ProcessGroup`` subclass
  with no backend registered, so torch code that asks a group for its default
  device (FSDP1's sharded state dict builds a ``ShardedTensor`` that way) would
  raise "Default device not found"; ``install(device_type)`` adds the property
  and ``uninstall()`` removes it.
- ``abort()`` wakes every thread blocked in a collective; each raises
  ``SystemExit`` with :data:`ABORT_TEXT`. ``reset()`` clears that state for
  the next run.
- Collectives used by FSDP implementations work on it: all_gather(_single),
  reduce_scatter(_single), all_reduce (SUM/AVG/MAX/MIN), broadcast, barrier,
  subgroups and a 2-D DeviceMesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.testing._internal.distributed import multi_threaded_pg as _mtpg

__all__ = ["BACKEND", "ABORT_TEXT", "install", "uninstall", "abort", "reset", "is_abort"]

BACKEND = "threaded"
ABORT_TEXT = "Test termination event occurs."


def _set_isolation(enabled: bool) -> None:
    getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode")(enabled)  # noqa: B009 - private binding


_installed_device_types: list[Any] = []


def install(device_type: str = "cpu") -> Any:
    """Thread-local c10d world, thread-isolated group-name registry, autograd multithreading off."""
    _set_isolation(True)
    types = property(lambda self: [torch.device(device_type)])
    _installed_device_types[:] = [types]
    _mtpg.ProcessLocalGroup._device_types = types  # type: ignore[misc,assignment]
    return _mtpg._install_threaded_pg()


def uninstall() -> None:
    _mtpg._uninstall_threaded_pg()
    if _installed_device_types and vars(_mtpg.ProcessLocalGroup).get("_device_types") is _installed_device_types[0]:
        del _mtpg.ProcessLocalGroup._device_types
    _installed_device_types.clear()
    _set_isolation(False)


def abort() -> None:
    """Wake every rank blocked in a threaded collective (they raise SystemExit)."""
    _mtpg.ProcessLocalGroup.exception_handle(None)


def reset() -> None:
    _mtpg.ProcessLocalGroup.reset()


def is_abort(exc: BaseException) -> bool:
    return isinstance(exc, SystemExit) and str(exc.code) == ABORT_TEXT
