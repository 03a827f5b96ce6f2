"""Settings resolved from their sources, naming the source that won.

Precedence, stated once for the whole project: a pytest marker on the test >
the command line > an environment variable > an ini option > the default.
:func:`resolve` applies it to one setting; a value that does not parse is a
:class:`SettingError` naming the source and the value. :func:`choice` and
:func:`whole_number` are the parsers every setting uses. The rank mode is
resolved with them in :mod:`harness.ranks.rank_mode`; the conformance runner builds
its settings on the same functions (``conformance.runner.settings``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Resolved", "SettingError", "appendable_file", "choice", "resolve", "whole_number", "word_or_whole_number"]

T = TypeVar("T")


class SettingError(ValueError):
    """A setting's value is invalid; the message names the setting's source and the value."""


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """A setting's value and where it came from (``--fsdp-rank-mode``, ``FSDP_RANK_MODE``, ``default``...)."""

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
    ini). Every given candidate is parsed, the ones that lose included, so a
    bad environment variable is reported even when the command line overrides
    it. ``parse`` raises ``ValueError`` for a bad value; the error is re-raised
    as :class:`SettingError` naming ``source`` and the raw value.
    """
    winner: Resolved[T] | None = None
    for source, raw in candidates:
        if raw is None or raw == "" or raw == []:
            continue
        try:
            value = parse(raw)
        except ValueError as exc:
            raise SettingError(f"{source}={raw!r}: {exc}") from exc
        winner = winner or Resolved(name, value, source)
    return winner or Resolved(name, default, "default")


def choice(choices: Sequence[str]) -> Callable[[Any], str]:
    """A parser accepting exactly one of ``choices`` (surrounding spaces ignored)."""

    def parse(raw: Any) -> str:
        value = str(raw).strip()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value

    return parse


def whole_number(minimum: int) -> Callable[[Any], int]:
    """A parser accepting a whole number >= ``minimum``."""

    def parse(raw: Any) -> int:
        try:
            value = int(str(raw).strip())
        except ValueError:
            raise ValueError(f"expected a whole number >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"expected a whole number >= {minimum}")
        return value

    return parse


def word_or_whole_number(words: Sequence[str], minimum: int) -> Callable[[Any], int | str]:
    """A parser accepting one of ``words`` (e.g. ``auto``) or a whole number >= ``minimum``."""
    number = whole_number(minimum)

    def parse(raw: Any) -> int | str:
        if str(raw).strip() in words:
            return str(raw).strip()
        try:
            return number(raw)
        except ValueError:
            raise ValueError(f"expected {' or '.join(words)} or a whole number >= {minimum}") from None

    return parse


def appendable_file(raw: Any) -> str:
    """A parser accepting a path a run can append lines to: an existing regular file it may write, or a new
    file in an existing directory. The file is opened for appending (and so created, empty, if missing), the
    one test that holds on every file system (``/proc`` included)."""
    path = str(raw).strip()
    if os.path.isdir(path):
        raise ValueError("is a directory; expected a file to append to")
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ValueError(f"cannot append to it ({exc.strerror})") from None
    return path
