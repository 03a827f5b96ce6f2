"""The conformance run's settings, each with the source it came from.

One resolver for the plugin and the CLI (:func:`resolve_settings`). Precedence
is the project's (:mod:`harness.settings`): marker > command line >
environment > default. The only marker today is a case's declared rank modes,
which bound the rank mode chosen here.

- impls: ``--fsdp-impl`` (pytest) / ``--impl`` (CLI), repeatable; then
  ``FSDP_CONFORMANCE_IMPL`` (comma separated); default ``reference``.
- rank mode: ``--rank-mode``; then ``FSDP_RANK_MODE``; then the ini option
  ``rank_mode``; default ``both``.
- timing repeats: ``--timing-repeats``; then ``FSDP_CONFORMANCE_TIMING_REPEATS``;
  default 3. Cases receive it as the ``timing_repeats`` fixture.
- workers: ``-n auto|N`` (pytest-xdist's option, which the CLI passes on);
  default 0, one process running cases one after another. ``auto`` is fitted
  to the cores (:func:`harness.scheduling.auto_workers`: one worker per
  two cores, at least two from two cores on, serial on one core).
- device: ``--device``; then ``FSDP_DEVICE``; default ``auto``. One of
  ``auto``, ``cpu``, ``cuda`` ([Note: device setting] in :mod:`harness.devices`).

A new setting (the compute device, the number of parallel workers) is a new
field of :class:`Settings` resolved in :func:`resolve_settings` with
:func:`harness.settings.resolve`, plus its command-line option in the plugin
and the CLI; nothing else reads the environment for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conformance.contract import registry
from harness.devices import SETTINGS as DEVICE_SETTINGS
from harness.settings import RANK_MODE_ENV, Resolved, SettingError, resolve, resolve_rank_mode

__all__ = ["IMPL_ENV", "TIMING_REPEATS_ENV", "DEVICE_ENV", "Settings", "SettingError", "resolve_settings"]

IMPL_ENV = "FSDP_CONFORMANCE_IMPL"
TIMING_REPEATS_ENV = "FSDP_CONFORMANCE_TIMING_REPEATS"
DEFAULT_TIMING_REPEATS = 3
DEVICE_ENV = "FSDP_DEVICE"


@dataclass(frozen=True)
class Settings:
    """Resolved settings of one run."""

    impls: Resolved[tuple[str, ...]]
    rank_mode: Resolved[str]
    timing_repeats: Resolved[int]
    workers: Resolved[int | str] = Resolved("workers", 0, "default")
    device: Resolved[str] = Resolved("device", "auto", "default")

    def describe(self) -> str:
        """One line, e.g. ``impls: ('reference',) (from default); rank mode: thread (from FSDP_RANK_MODE)``."""
        return "; ".join(s.describe() for s in (self.impls, self.rank_mode, self.timing_repeats, self.workers,
                                                self.device))


def _parse_impls(raw: Any) -> tuple[str, ...]:
    names = raw.split(",") if isinstance(raw, str) else list(raw)
    wanted = registry.expand([n.strip() for n in names if n.strip()])
    if not wanted:
        raise ValueError("names no implementation")
    known = registry.registered()
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; registered: {', '.join(sorted(known))}")
    return tuple(wanted)


def _parse_repeats(raw: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError("expected a whole number >= 1") from None
    if value < 1:
        raise ValueError("expected a whole number >= 1")
    return value


def _parse_workers(raw: Any) -> int | str:
    if str(raw).strip() == "auto":
        return "auto"
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError("expected auto or a whole number >= 0") from None
    if value < 0:
        raise ValueError("expected auto or a whole number >= 0")
    return value
def _parse_device(raw: Any) -> str:
    if raw not in DEVICE_SETTINGS:
        raise ValueError(f"expected one of {', '.join(DEVICE_SETTINGS)}")
    return str(raw)


def resolve_settings(
    cli: Mapping[str, tuple[str, Any]],
    env: Mapping[str, str] | None = None,
    ini: Mapping[str, Any] | None = None,
) -> Settings:
    """Resolve every setting.

    ``cli`` maps a setting (``impls``, ``rank_mode``, ``timing_repeats``, ``workers``, ``device``) to
    ``(option as spelled, value or None)``, so errors name the option the user
    typed; ``env`` defaults to ``os.environ``; ``ini`` holds ini options
    (``rank_mode``). Raises :class:`SettingError` naming the source of a bad value.
    """
    env = os.environ if env is None else env
    ini = ini or {}
    impl_flag, impl_cli = cli.get("impls", ("--fsdp-impl", None))
    mode_flag, mode_cli = cli.get("rank_mode", ("--rank-mode", None))
    repeats_flag, repeats_cli = cli.get("timing_repeats", ("--timing-repeats", None))
    workers_flag, workers_cli = cli.get("workers", ("-n", None))
    device_flag, device_cli = cli.get("device", ("--device", None))
    return Settings(
        impls=resolve("impls", [(impl_flag, impl_cli), (IMPL_ENV, env.get(IMPL_ENV))], _parse_impls,
                      ("reference",)),
        rank_mode=resolve_rank_mode(cli=mode_cli, env=env.get(RANK_MODE_ENV), ini=ini.get("rank_mode"),
                                    cli_flag=mode_flag),
        timing_repeats=resolve("timing repeats", [(repeats_flag, repeats_cli),
                                                  (TIMING_REPEATS_ENV, env.get(TIMING_REPEATS_ENV))],
                               _parse_repeats, DEFAULT_TIMING_REPEATS),
        workers=resolve("workers", [(workers_flag, workers_cli)], _parse_workers, 0),
        device=resolve("device", [(device_flag, device_cli), (DEVICE_ENV, env.get(DEVICE_ENV))], _parse_device,
                       "auto"),
    )
