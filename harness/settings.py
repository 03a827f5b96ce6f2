"""Settings resolved from their sources, naming the source that won.

Precedence, stated once for the whole project: a pytest marker on the test >
the command line > an environment variable > an ini option > the default.
:func:`resolve` applies it to one setting; a value that does not parse is a
:class:`SettingError` naming the source and the value. The harness resolves
the rank mode here; the conformance suite builds its settings on the same
function (``conformance.runner.settings``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["RANK_MODE_ENV", "RANK_MODES", "Resolved", "SettingError", "modes_of", "resolve", "resolve_rank_mode"]

T = TypeVar("T")

RANK_MODE_ENV = "FSDP_RANK_MODE"
#: Rank-mode choices; ``both`` means process then thread.
RANK_MODES = ("process", "thread", "both")


class SettingError(ValueError):
    """A setting's value is invalid; the message names the setting's source and the value."""


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """A setting's value and where it came from (``--rank-mode``, ``FSDP_RANK_MODE``, ``default``...)."""

    name: str
    value: T
    source: str

    def describe(self) -> str:
        return f"{self.name}: {self.value} (from {self.source})"


def resolve(
    name: str,
    candidates: Sequence[tuple[str, Any]],
    parse: Callable[[Any], T],
    default: T,
) -> Resolved[T]:
    """The first candidate ``(source, raw)`` whose raw value is given (not ``None`` or ``""``), parsed.

    ``candidates`` are in precedence order (marker, command line, environment,
    ini). ``parse`` raises ``ValueError`` for a bad value; the error is
    re-raised as :class:`SettingError` naming ``source`` and the raw value.
    """
    for source, raw in candidates:
        if raw is None or raw == "" or raw == []:
            continue
        try:
            return Resolved(name, parse(raw), source)
        except ValueError as exc:
            raise SettingError(f"{source}={raw!r}: {exc}") from exc
    return Resolved(name, default, "default")


def _parse_rank_mode(raw: Any) -> str:
    value = str(raw).strip()
    if value not in RANK_MODES:
        raise ValueError(f"expected one of {', '.join(RANK_MODES)}")
    return value


def resolve_rank_mode(*, cli: str | None, env: str | None, ini: str | None = None,
                      cli_flag: str = "--rank-mode") -> Resolved[str]:
    """The rank mode: ``cli_flag`` > :data:`RANK_MODE_ENV` > ini ``rank_mode`` > ``both``."""
    return resolve(
        "rank mode",
        [(cli_flag, cli), (RANK_MODE_ENV, env), ("ini rank_mode", ini)],
        _parse_rank_mode,
        "both",
    )


def modes_of(rank_mode: str) -> tuple[str, ...]:
    """The rank modes a rank-mode choice runs, in order."""
    return ("process", "thread") if rank_mode == "both" else (rank_mode,)
