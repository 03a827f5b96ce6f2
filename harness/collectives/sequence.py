"""Each rank's place in its collective sequence, and blaming the rank that left the sequence.

[Note: collective mismatch]
When one rank skips a collective (or calls a different one), the ranks that
did call it wait: they time out, or (thread ranks, torch's threaded group)
raise whatever torch's internals raise when peers disagree, such as
``AttributeError: 'list' object has no attribute 'to'``. The waiting ranks
are the victims; [Note: failure attribution] in :mod:`harness.ranks.errors` wants
the culprit named first. So every rank counts the collectives it enters
(through :func:`harness.collectives.recorder.observing`, the ``torch.distributed``
functions) in a :class:`Slot`: a few bytes that the parent can read while
the rank is blocked (process ranks: a file the rank maps into memory; thread
ranks: a buffer of the thread host). When a run fails by a timeout, or by an
exception raised *inside* a collective, :func:`attributed` looks at every
rank's position:

- the ranks inside a collective wait in the furthest one, call number ``n``;
  a rank outside any collective having entered fewer than ``n`` (it returned,
  or is busy elsewhere) *did not reach* it: it is blamed, the waiting ranks
  are ``aborted``;
- else, when the ranks at call ``n`` are in different collectives, the
  majority's is taken as the expected one (on a tie, the lowest rank's), and
  the ranks in another are blamed for calling it.

A rank that raised outside any collective, died, or skipped keeps the blame
[Note: failure attribution] gives it; when the failure is reconsidered all the
same (another rank's primary failure was a timeout or raised inside a
collective) and that rank is the one behind, its blame carries what it raised. Only the ``torch.distributed``
functions are counted: collectives issued through functional collectives
(DTensor's) are invisible here, and counts are per rank, not per group, so
two ranks legitimately issuing different numbers of subgroup collectives
could be misread; the stacks of every rank stay in the message.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from harness.collectives.recorder import CANONICAL
from harness.ranks.errors import RankError, RankFailure, make_failure

__all__ = ["OPS", "SLOT_SIZE", "Blame", "Position", "Slot", "attributed", "blame", "create_slot_file", "map_slot_file",
           "read_slot_file"]

#: Collectives a slot can name, by index.
OPS = tuple(sorted(set(CANONICAL.values())))
_LAYOUT = struct.Struct("<qqq")  # calls entered, index of the last op in OPS, state
SLOT_SIZE = _LAYOUT.size
_OUTSIDE, _INSIDE, _RAISED = 0, 1, 2


@dataclass(frozen=True)
class Position:
    """Where one rank is in its collective sequence."""

    rank: int
    #: Collectives entered since the task started.
    calls: int
    #: The last one entered (``""`` before the first).
    op: str
    #: Inside it now, or left it by an exception (then it is where the rank failed).
    inside: bool


class Slot:
    """One rank's position, written by the rank on each collective
    (a :class:`harness.collectives.recorder.Observer`)."""

    def __init__(self, buffer: bytearray | mmap.mmap) -> None:
        self._buffer = buffer
        self._calls = 0
        self._op = 0
        self.reset()

    def reset(self) -> None:
        """A new task: no collective entered yet."""
        self._calls, self._op = 0, 0
        _LAYOUT.pack_into(self._buffer, 0, 0, 0, _OUTSIDE)

    def entered(self, op: str) -> None:
        self._calls, self._op = self._calls + 1, OPS.index(op)
        _LAYOUT.pack_into(self._buffer, 0, self._calls, self._op, _INSIDE)

    def left(self, *, raised: bool) -> None:
        _LAYOUT.pack_into(self._buffer, 0, self._calls, self._op, _RAISED if raised else _OUTSIDE)

    def position(self, rank: int) -> Position:
        return _position(rank, bytes(self._buffer[:SLOT_SIZE]))


def _position(rank: int, data: bytes) -> Position:
    calls, op, state = _LAYOUT.unpack(data[:SLOT_SIZE]) if len(data) >= SLOT_SIZE else (0, 0, _OUTSIDE)
    return Position(rank, calls, OPS[op] if calls else "", state != _OUTSIDE)


def create_slot_file(path: str) -> None:
    """The file a rank process maps its slot onto (created by the parent, so it always exists)."""
    with open(path, "wb") as f:
        f.write(bytes(SLOT_SIZE))


def map_slot_file(path: str) -> Slot:
    """A rank process's slot, shared with the parent through ``path``."""
    with open(path, "r+b") as f:
        return Slot(mmap.mmap(f.fileno(), SLOT_SIZE))


def read_slot_file(rank: int, path: str) -> Position:
    """The parent's view of a rank process's slot."""
    try:
        with open(path, "rb") as f:
            return _position(rank, f.read(SLOT_SIZE))
    except OSError:
        return Position(rank, 0, "", False)


@dataclass(frozen=True)
class Blame:
    """Who left the collective sequence, and who waits for them."""

    #: Blamed rank -> what it did, completing "rank R ...".
    culprits: dict[int, str]
    waiting: tuple[int, ...]
    #: "all_reduce #2", the collective the waiting ranks are in.
    where: str


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def blame(positions: Mapping[int, Position], returned: set[int]) -> Blame | None:
    """The ranks that left the collective sequence ([Note: collective mismatch]); ``None`` if none did."""
    inside = {r: p for r, p in positions.items() if p.inside}
    if not inside:
        return None
    furthest = max(p.calls for p in inside.values())
    at_furthest = {r: p for r, p in sorted(inside.items()) if p.calls == furthest}
    counts = Counter(p.op for p in at_furthest.values())
    top = max(counts.values())
    expected = next(p.op for p in at_furthest.values() if counts[p.op] == top)  # a tie: the lowest rank's
    waiting = tuple(r for r, p in at_furthest.items() if p.op == expected)
    where = f"{expected} #{furthest}"
    behind = {r: p for r, p in sorted(positions.items()) if r not in inside and p.calls < furthest}
    if behind:
        how = {r: "it returned" if r in returned else "it is outside any collective" for r in behind}
        culprits = {r: f"did not reach {where}, which {_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} "
                    f"in ({how[r]} after {p.calls} collective{'' if p.calls == 1 else 's'})"
                    for r, p in behind.items()}
        return Blame(culprits, waiting, where)
    odd = {r: p for r, p in at_furthest.items() if p.op != expected}
    if not odd:
        return None
    culprits = {r: f"called {p.op} as collective #{furthest} where {_ranks(waiting)} called {expected}"
                for r, p in odd.items()}
    return Blame(culprits, waiting, where)


def attributed(failure: RankFailure, positions: Mapping[int, Position]) -> RankFailure:
    """``failure`` with the blame moved to the rank that left the collective sequence, if one did.

    Only a timeout or an exception raised inside a collective is reconsidered
    ([Note: collective mismatch]); anything else is returned as it is.
    """
    primary = failure.failures[0]
    reconsider = primary.kind == "timed_out" or (
        primary.kind == "raised" and positions.get(primary.rank, Position(primary.rank, 0, "", False)).inside)
    if not reconsider:
        return failure
    failed = {f.rank for f in failure.failures}
    found = blame(positions, returned={r for r in positions if r not in failed})
    if found is None:
        return failure
    by_rank = {f.rank: f for f in failure.failures}
    errors = [RankError(r, "collective", text + _own(by_rank.get(r)), traceback=_kept(by_rank.get(r), "traceback"),
                        stack=_kept(by_rank.get(r), "stack")) for r, text in found.culprits.items()]
    culprits = _ranks(sorted(found.culprits))
    for f in failure.failures:
        if f.rank in found.culprits:
            continue
        what = f"waiting in {found.where} for {culprits}" if f.rank in found.waiting else f"after {culprits}"
        seen = f" ({f.headline()})" if f.kind in ("raised", "timed_out") else ""
        errors.append(RankError(f.rank, "aborted", what + seen, traceback=f.traceback, stack=f.stack))
    return make_failure(errors, world_size=failure.world_size, mode=failure.mode)


def _own(error: RankError | None) -> str:
    """A blamed rank's own exception, kept in its blame: what it raised is why it left the sequence."""
    return f"; it raised {error.summary}" if error is not None and error.kind == "raised" else ""


def _kept(error: RankError | None, field: str) -> str:
    return "" if error is None else str(getattr(error, field))
