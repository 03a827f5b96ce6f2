"""One verdict per fuzz run, the same on every rank: a failure is kept, then all ranks agree on it.

[Note: fuzz verdicts agree across ranks]
A mismatch never raises mid-step: it is kept and the step goes on, so a rank
never leaves the others waiting in the implementation's next collective. After
the wrap and after every step, ranks all-gather their failure text (a kept
mismatch, or an exception from the implementation) and all stop at the first
one, so every rank reaches the same verdict, which the driver
(:mod:`conformance.fuzz.driver`) hands to hypothesis. A check of the
fuzzer's own that raises is kept like a failed assertion. The stateful fuzzer
agrees on each operation before its state check, whose collectives (gathers
of full values) run only once every rank is through the operation: a rank
that raised at the operation's end would otherwise meet its peers' first
gather with its verdict's all-gather in the same process group, collectives
of different sizes that gloo pairs without noticing (measured: the raising
rank read a float as its peer's object size and tried to allocate 4.5e18
bytes, while the peer waited in ``DTensor.full_tensor``).

An implementation that raises on some ranks but not others in the middle of
its own collectives leaves the others waiting in its next collective, where
no verdict can reach them: the raising rank's all-gather would meet their
collective (gloo aborts the process on the size mismatch; thread ranks
hang). So the stateful fuzzer agrees through :class:`Verdicts`: before each
all-gather every rank marks its arrival in the default process group's
store, and a rank whose failure is an exception first waits up to
:data:`PEERS_WAIT_S` seconds for every peer's mark; a peer missing then is
stuck inside the implementation, and the rank raises :class:`RanksParted`
(a ``BaseException``, which hypothesis does not take for a failing example
to shrink) naming the operation and its failure instead of entering the
all-gather. The row then FAILs with that program; the run cannot go on, as
its peers never leave that collective.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["PEERS_WAIT_S", "RanksParted", "Verdicts", "agree", "attempt", "fail"]

#: How long a rank whose operation raised waits for its peers to reach the verdict before it takes them for
#: stuck inside the implementation's collectives: an operation takes well under a second on a loaded 2-core
#: machine, so a peer still missing after this long is waiting for this rank in a collective.
PEERS_WAIT_S = 20.0


def attempt(what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, failure text)`` if it raised."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - any exception is this rank's verdict (see the module note)
        text = str(exc).strip().splitlines()
        return None, f"{what}: {type(exc).__name__}: {' | '.join(text[:6])}"


def fail(message: str) -> None:
    """Raise ``AssertionError(message)`` (a check with its verdict already made, for ``compare``)."""
    raise AssertionError(message)


def agree(ctx: RankContext, failure: str | None) -> str | None:
    """The first rank's failure text, the same on every rank, or ``None`` if none failed."""
    failures = ctx.all_gather_object(failure)
    return next((f"rank {rank}: {text}" for rank, text in enumerate(failures) if text), None)


class RanksParted(BaseException):
    """A rank raised in the middle of the implementation's collectives while its peers went on into them: no
    verdict can be agreed, and the run ends with this rank's failure (see the module note). ``value``, the
    program or example run, is set by whoever knows it."""

    def __init__(self, message: str, value: Any = None) -> None:
        super().__init__(message)
        self.value = value


class Verdicts:
    """The verdicts of one program on this rank, agreed after each step, with the peers' arrival checked
    where this rank raised (see the module note). Collective: every rank makes one per program."""

    def __init__(self, ctx: RankContext, wait_s: float = PEERS_WAIT_S) -> None:
        self.ctx, self.wait_s, self.count = ctx, wait_s, 0
        nonce = ctx.all_gather_object(uuid.uuid4().hex)[0]  # rank 0's: one key space per program
        self.prefix = f"fsdp-conformance/fuzz-verdicts/{nonce}"

    def agree(self, failure: str | None, *, raised: str | None = None, where: str = "") -> str | None:
        """:func:`agree` on ``raised or failure``; ``raised``, an exception this rank met in the implementation,
        first waits for every peer to arrive, else raises :class:`RanksParted` naming ``where`` it raised."""
        self.count += 1
        key = f"{self.prefix}/{self.count}"
        store = dist.distributed_c10d._get_default_store()
        arrived = store.add(key, 1)
        deadline = time.monotonic() + self.wait_s
        while raised is not None and arrived < self.ctx.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(key, 0)
        if raised is not None and arrived < self.ctx.world_size:
            at = f"{where}, " if where else ""
            raise RanksParted(f"{at}rank {self.ctx.rank}: {raised}; its peers did not reach the verdict within "
                              f"{self.wait_s:.0f} s (only {arrived} of {self.ctx.world_size} ranks did): the "
                              "others are left waiting in the implementation's collectives")
        return agree(self.ctx, raised or failure)
