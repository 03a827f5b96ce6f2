"""What a multi-rank run reports when a rank fails.

[Note: failure attribution]
The *primary* failure is the rank that went wrong first: it raised, died or
(at the timeout) had not finished. Ranks that were only waiting for it in a
collective are *secondary*: listed as ``aborted`` ("aborted after rank 1
failed"), never blamed. A death outranks an exception: when a rank process
dies, its peers' collectives fail with connection errors, which may reach
the parent before the death does. The first line of the message names the primary
rank and kind, so a one-line CI summary is enough to know where to look.
The order, in :data:`BLAME_ORDER` (ties keep the caller's arrival or rank order):
died, collective (the rank that left the collective sequence the others wait in,
[Note: collective mismatch] in :mod:`harness.collectives.sequence`), raised, timed_out,
skipped, aborted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BLAME_ORDER",
    "KINDS",
    "RankError",
    "RankFailure",
    "RankRaised",
    "RankTimedOut",
    "RankDied",
    "InconsistentSkip",
    "CollectiveMismatch",
    "make_failure",
]

#: ``aborted`` is only ever secondary; ``collective``: the rank left the collective sequence the others follow.
KINDS = ("raised", "timed_out", "died", "aborted", "skipped", "collective")
#: Which failure kind is blamed first ([Note: failure attribution]).
BLAME_ORDER = {"died": 0, "collective": 1, "raised": 2, "timed_out": 3, "skipped": 4, "aborted": 5}


@dataclass
class RankError:
    """One rank's failure."""

    rank: int
    kind: str
    summary: str
    traceback: str = ""
    exitcode: int | None = None
    signal_name: str | None = None
    stack: str = ""
    #: Wall-clock time (``time.time()``) at which the parent observed the failure.
    detected_at: float | None = None
    #: Where the rank runs, when the run spans nodes: ``node 1, local rank 1`` ([Note: job layout] in
    #: :mod:`harness.ranks.launched`); ``""`` for spawned ranks.
    where: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"RankError.kind must be one of {KINDS}, got {self.kind!r}")

    def headline(self) -> str:
        rank = f"rank {self.rank}" + (f" ({self.where})" if self.where else "")
        if self.kind == "raised":
            return f"{rank} raised {self.summary}"
        if self.kind == "died":
            how = f"signal {self.signal_name}" if self.signal_name else f"exit code {self.exitcode}"
            return f"{rank} died ({how}){': ' + self.summary if self.summary else ''}"
        if self.kind == "timed_out":
            return f"{rank} timed out: {self.summary}"
        if self.kind == "skipped":
            return f"{rank} skipped: {self.summary}"
        if self.kind == "collective":
            return f"{rank} {self.summary}"
        return f"{rank} aborted: {self.summary}"

    def details(self) -> str:
        parts = [f"--- {self.headline()}"]
        if self.traceback:
            parts.append(self.traceback.rstrip())
        if self.stack:
            parts.append(f"stack of rank {self.rank}:\n{self.stack.rstrip()}")
        return "\n".join(parts)


class RankFailure(Exception):
    """A multi-rank run failed; ``failures[0]`` is the primary failure."""

    def __init__(self, failures: Sequence[RankError], *, world_size: int, mode: str) -> None:
        if not failures:
            raise ValueError("RankFailure needs at least one RankError")
        self.failures = list(failures)
        self.world_size = world_size
        self.mode = mode
        super().__init__(self._message())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles with its failures (it travels from a thread host to the parent)."""
        return (_rebuild, (type(self), self.failures, self.world_size, self.mode))

    @property
    def rank(self) -> int:
        return self.failures[0].rank

    @property
    def kind(self) -> str:
        return self.failures[0].kind

    def _message(self) -> str:
        head = f"{self.failures[0].headline()} (world_size={self.world_size}, mode={self.mode})"
        others = [f.headline() for f in self.failures[1:]]
        lines = [head]
        if others:
            lines.append("also: " + "; ".join(others))
        lines += [f.details() for f in self.failures]
        return "\n".join(lines)


class RankRaised(RankFailure):
    """The primary rank raised an exception."""


class RankTimedOut(RankFailure):
    """The run did not finish within its timeout; every unfinished rank's stack is attached."""


class RankDied(RankFailure):
    """A rank process exited or was killed without reporting."""


class InconsistentSkip(RankFailure):
    """Some ranks skipped and others did not: a case bug, reported as an error."""


class CollectiveMismatch(RankFailure):
    """The primary rank did not reach the collective the others wait in, or called another one."""


def _rebuild(cls: type[RankFailure], failures: list[RankError], world_size: int, mode: str) -> RankFailure:
    return cls(failures, world_size=world_size, mode=mode)


_BY_KIND: dict[str, type[RankFailure]] = {
    "raised": RankRaised,
    "timed_out": RankTimedOut,
    "died": RankDied,
    "skipped": InconsistentSkip,
    "collective": CollectiveMismatch,
}


def make_failure(failures: Sequence[RankError], *, world_size: int, mode: str) -> RankFailure:
    """The :class:`RankFailure` subclass matching the primary failure.

    ``failures`` come in the caller's order (arrival or rank order) and are
    ordered by :data:`BLAME_ORDER`, stably ([Note: failure attribution]).
    """
    ordered = sorted(failures, key=lambda f: BLAME_ORDER[f.kind])
    cls = _BY_KIND.get(ordered[0].kind, RankFailure)
    return cls(ordered, world_size=world_size, mode=mode)
