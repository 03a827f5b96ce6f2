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
bytes, while the peer waited in ``DTensor.full_tensor``). Only an implementation that raises on
some ranks but not others in the middle of its own collectives can still hang
a run; the harness then names the hung rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["agree", "attempt", "fail"]


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
