"""A rank's result as a picklable value, and turning all ranks' results into one answer.

[Note: skips travel as values]
A rank never exits with a magic code. It returns an :class:`Outcome`: the
return value, or the exception (type, message, formatted traceback, and the
exception itself when it pickles). pytest outcome exceptions (skip, and
subclasses such as the conformance suite's "not applicable") are recognised
by type; when every rank skipped with the same class and message the caller
re-raises that skip, and when only some did the run is an error
(:class:`~harness.ranks.errors.InconsistentSkip`).
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from harness.ranks.errors import RankError, make_failure

__all__ = ["Outcome", "ABORT_MESSAGE", "as_error", "capture", "resolve", "skip_exception"]

#: Text of the exception a rank gets when a collective is aborted because another rank failed.
ABORT_MESSAGE = "aborted: another rank failed while this rank waited in a collective"

_SKIP = pytest.skip.Exception


@dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    exc_pickle: bytes | None = None
    is_skip: bool = False
    aborted: bool = False


def _pickled(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - any unpicklable exception travels as text only
        return None
    return data


def capture(rank: int, exc: BaseException, *, aborted: bool = False) -> Outcome:
    """The outcome of a rank that raised ``exc``."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    is_skip = isinstance(exc, _SKIP)
    message = exc.msg if is_skip else str(exc)  # type: ignore[attr-defined]
    return Outcome(
        rank=rank,
        ok=False,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=message,
        traceback=text,
        exc_pickle=_pickled(exc),
        is_skip=is_skip,
        aborted=aborted,
    )


def _short_type(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1]


def as_error(o: Outcome, first_failed: int | None = None) -> RankError:
    """The :class:`RankError` a failed or skipped outcome stands for (``first_failed``: the rank an aborted
    one was waiting for, when known)."""
    if o.aborted:
        after = f" after rank {first_failed} failed" if first_failed is not None else ""
        return RankError(o.rank, "aborted", f"waiting in a collective{after}", traceback=o.traceback)
    kind = "skipped" if o.is_skip else "raised"
    return RankError(o.rank, kind, f"{_short_type(o.exc_type)}: {o.message}", traceback=o.traceback)


def resolve(outcomes: Sequence[Outcome], *, world_size: int, mode: str) -> list[Any]:
    """Per-rank values in rank order, or raise the one exception that describes the run."""
    outcomes = sorted(outcomes, key=lambda o: o.rank)
    if all(o.ok for o in outcomes):
        return [o.value for o in outcomes]
    failed = [o for o in outcomes if not o.ok and not o.is_skip and not o.aborted]
    skipped = [o for o in outcomes if o.is_skip]
    if not failed and len(skipped) == len(outcomes):
        kinds = {(o.exc_type, o.message) for o in skipped}
        if len(kinds) == 1:
            raise skip_exception(skipped[0])
    first = failed[0].rank if failed else None
    errors = [as_error(o, first) for o in outcomes if not o.ok]
    if not failed and skipped:
        passed = [o.rank for o in outcomes if o.ok]
        errors[0].summary += f" (ranks {passed} did not skip)" if passed else " (ranks disagree on the skip)"
    raise make_failure(errors, world_size=world_size, mode=mode)


def skip_exception(o: Outcome) -> BaseException:
    """The skip a skipped outcome carries, ready to raise (its own class when it unpickles)."""
    if o.exc_pickle is not None:
        exc = pickle.loads(o.exc_pickle)
        if isinstance(exc, _SKIP):
            return exc
    return _SKIP(o.message)
