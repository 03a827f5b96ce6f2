"""Run one test body on N ranks, as spawned processes or as threads of a host process, and attribute every fault.

``harness.run(fn, world_size=2, mode="process", placement="cpu")`` calls
``fn(ctx, ...)`` on every rank and returns the per-rank values, or raises a
:class:`RankFailure` whose first line names the rank and what went wrong. See
the module docs of :mod:`harness.devices` (placements), :mod:`harness.process`,
:mod:`harness.thread_host`, :mod:`harness.threads` and :mod:`harness.launched`.

Imports point one way: ``runner`` (top) > ``launched``, ``process``,
``thread_host`` > ``_host_main``, ``_rank_main``, ``threads`` > ``context``,
``outcome``, ``reset``, ``errors``, ``devices``, ``cpu_budget``, ``_rank_state``
(bottom). The package re-exports the public names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.context import RankContext
    from harness.errors import InconsistentSkip, RankDied, RankError, RankFailure, RankRaised, RankTimedOut
    from harness.rank_mode import RankMode
    from harness.recorder import Call, Trace, patch_collectives
    from harness.reset import groups_scope
    from harness.runner import run, shutdown_pools

#: Public name -> the module that owns it. Imported on first use, so that importing a light module of
#: the package (``harness.rank_mode``, ``harness.settings``) does not import torch.
_EXPORTS = {
    "run": "harness.runner", "shutdown_pools": "harness.runner", "RankMode": "harness.rank_mode",
    "RankContext": "harness.context", "patch_collectives": "harness.recorder", "Call": "harness.recorder",
    "Trace": "harness.recorder", "groups_scope": "harness.reset", **{name: "harness.errors" for name in (
        "RankFailure", "RankRaised", "RankTimedOut", "RankDied", "RankError", "InconsistentSkip")},
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "run",
    "RankMode",
    "RankContext",
    "RankFailure",
    "RankRaised",
    "RankTimedOut",
    "RankDied",
    "RankError",
    "InconsistentSkip",
    "shutdown_pools",
    "patch_collectives",
    "Call",
    "Trace",
    "groups_scope",
]
