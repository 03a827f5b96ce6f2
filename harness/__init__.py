"""Run one test body on N ranks, as spawned processes or as threads, and attribute every fault.

``harness.run(fn, world_size=2, mode="process")`` calls ``fn(ctx, ...)`` on every
rank and returns the per-rank values, or raises a :class:`RankFailure` whose
first line names the rank and what went wrong. See the module docs of
:mod:`harness.process`, :mod:`harness.threads` and :mod:`harness.launched`.
"""

from harness.context import RankContext
from harness.errors import (
    InconsistentSkip,
    RankDied,
    RankError,
    RankFailure,
    RankRaised,
    RankTimedOut,
)
from harness.recorder import Call, Trace, patch_collectives
from harness.runner import MODES, run, shutdown_pools

__all__ = [
    "run",
    "MODES",
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
]
