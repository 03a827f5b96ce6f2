"""Run one test body on N ranks, as spawned processes or as threads of a host process, and attribute every fault.

``harness.run(fn, world_size=2, mode="process", placement="cpu")`` calls
``fn(ctx, ...)`` on every rank and returns the per-rank values, or raises a
:class:`RankFailure` whose first line names the rank and what went wrong. See
the module docs of :mod:`harness.ranks.devices` (placements), :mod:`harness.ranks.process`,
:mod:`harness.ranks.thread_host`, :mod:`harness.ranks.threads` and :mod:`harness.ranks.launched`.

The package is grouped by its three jobs:

* :mod:`harness.ranks`: running ranks (process, thread and launched), their
  placement, their outcomes and failures;
* :mod:`harness.collectives`: observing, recording and sequencing the
  collectives ranks call;
* :mod:`harness.plugin`: the pytest plugin (``@pytest.mark.ranks``, its hooks,
  xdist scheduling);

and shares :mod:`harness.setting_sources` and :mod:`harness.environment` (settings and
the variables they are resolved from). Inside ``ranks``, imports point one way:
``runner`` (top) > ``launched``, ``process``, ``thread_host`` > ``_host_main``,
``_rank_main``, ``threads`` > ``context``, ``outcome``, ``reset``, ``errors``,
``devices``, ``cpu_budget``, ``_rank_state`` > ``kept_groups`` (bottom). The package re-exports
the public names. Older module paths (``harness.process``)
still import, with a ``DeprecationWarning`` naming the new one
(:mod:`harness.moved`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from harness.moved import serve_harness

if TYPE_CHECKING:
    from harness.collectives.recorder import Call, Trace, patch_collectives
    from harness.ranks.context import RankContext
    from harness.ranks.errors import InconsistentSkip, RankDied, RankError, RankFailure, RankRaised, RankTimedOut
    from harness.ranks.rank_mode import RankMode
    from harness.ranks.reset import groups_scope
    from harness.ranks.runner import run, shutdown_pools

#: Public name -> the module that owns it. Imported on first use, so that importing a light module of
#: the package (``harness.ranks.rank_mode``, ``harness.setting_sources``) does not import torch.
_EXPORTS = {
    "run": "harness.ranks.runner", "shutdown_pools": "harness.ranks.runner", "RankMode": "harness.ranks.rank_mode",
    "RankContext": "harness.ranks.context", "groups_scope": "harness.ranks.reset",
    **{name: "harness.collectives.recorder" for name in ("patch_collectives", "Call", "Trace")},
    **{name: "harness.ranks.errors" for name in (
        "RankFailure", "RankRaised", "RankTimedOut", "RankDied", "RankError", "InconsistentSkip")},
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


serve_harness()

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
