"""The options a run is configured by, declared once.

[Note: one table of options]
Every setting a run takes on its command line is one :class:`Option` of
:data:`OPTIONS`: the setting's name and label, its ``fsdp-conformance run``
flag, the pytest option the CLI forwards it as, its variable, its parser and
default, and the one help text both command lines show. The CLI's parser and
forwarding (:mod:`conformance.runner.cli`), the plugin's pytest options
(:mod:`conformance.runner.plugin`), the resolver
(:func:`conformance.runner.settings.resolve_settings`) and the rows of
docs/USAGE.md's settings table (:func:`usage_rows`, compared by
``test_rows_settings``) are all made from it, so a setting is declared once.
Two options belong to other plugins and are only described here: the rank
mode's pytest option is the harness's (:mod:`harness.plugin.pytest_plugin` resolves
it), ``-n`` is pytest-xdist's. This module imports neither torch nor pytest
(``fsdp-conformance --help`` reads it): parsers that need the registry or the
devices import them when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from harness.ranks.rank_mode import SELECTIONS
from harness.setting_sources import choice, whole_number, word_or_whole_number

__all__ = ["CASE_TIMEOUT_ENV", "DEVICE_ENV", "FUZZ_EXAMPLES_ENV", "FUZZ_SEED_ENV", "FUZZ_STATEFUL_EXAMPLES_ENV",
           "FUZZ_SHRINK_ENV", "FUZZ_VERBOSE_ENV", "IMPL_ENV", "MAX_TIME_ENV", "OPTIONS", "Option", "RANK_MODE_ENV",
           "TIMING_REPEATS_ENV", "WORLD_SIZE_ENV", "usage_rows"]

IMPL_ENV = "FSDP_CONFORMANCE_IMPL"
TIMING_REPEATS_ENV = "FSDP_CONFORMANCE_TIMING_REPEATS"
DEVICE_ENV = "FSDP_DEVICE"
FUZZ_EXAMPLES_ENV = "FSDP_FUZZ_EXAMPLES"
FUZZ_SEED_ENV = "FSDP_FUZZ_SEED"
FUZZ_VERBOSE_ENV = "FSDP_FUZZ_VERBOSE"
CASE_TIMEOUT_ENV = "FSDP_CONFORMANCE_CASE_TIMEOUT"
MAX_TIME_ENV = "FSDP_CONFORMANCE_MAX_TIME"
FUZZ_STATEFUL_EXAMPLES_ENV = "FSDP_FUZZ_STATEFUL_EXAMPLES"
FUZZ_SHRINK_ENV = "FSDP_FUZZ_SHRINK"
WORLD_SIZE_ENV = "FSDP_WORLD_SIZE"
#: Read by the harness's plugin (:mod:`harness.plugin.pytest_plugin`), which resolves the rank mode.
RANK_MODE_ENV = "FSDP_RANK_MODE"


def _parse_impls(raw: Any) -> tuple[str, ...]:
    # ``--impl a,b``, ``--impl a --impl b`` and ``FSDP_CONFORMANCE_IMPL=a,b`` all name a and b.
    from conformance.contract import registry

    names = [name for item in ([raw] if isinstance(raw, str) else raw) for name in str(item).split(",")]
    wanted = registry.expand([n.strip() for n in names if n.strip()])
    if not wanted:
        raise ValueError("names no implementation")
    known = registry.registered()
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; registered: {', '.join(sorted(known))}")
    return tuple(wanted)


def _parse_device(raw: Any) -> str:
    from harness.ranks.devices import SETTINGS

    return choice(SETTINGS)(raw)


def _parse_flag(raw: Any) -> bool:
    """``True``/``1`` or ``False``/``0`` (a command-line switch gives the bool itself)."""
    if isinstance(raw, bool):
        return raw
    return choice(("0", "1"))(raw) == "1"


@dataclass(frozen=True)
class Option:
    """A setting with a command-line option ([Note: one table of options])."""

    #: The :class:`~conformance.runner.settings.Settings` field, and the key of
    #: :func:`~conformance.runner.settings.resolve_settings`'s ``cli``.
    name: str
    #: How messages and the run's settings line name it.
    label: str
    #: ``fsdp-conformance run``'s spelling, and the pytest option it is forwarded as.
    run_flag: str
    pytest_flag: str
    env: str | None
    #: The value's parser (``None``: another plugin resolves it) and its default.
    parse: Callable[[Any], Any] | None
    default: Any
    metavar: str | None
    #: The help both command lines show (its default is added), and docs/USAGE.md's "what" and "default".
    help: str
    what: str
    default_text: str
    #: ``value``: one value; ``append``: repeatable; ``switch``: on when given.
    kind: Literal["value", "append", "switch"] = "value"
    #: ``suite``: this suite's plugin adds the pytest option; ``harness``, ``xdist``: that plugin does.
    owner: Literal["suite", "harness", "xdist"] = "suite"

    def help_text(self) -> str:
        """The help with its default, e.g. ``... (default: $FSDP_DEVICE or auto)``."""
        default = self.default_text.replace("`", "")
        return f"{self.help} (default: {'$' + self.env + ' or ' if self.env else ''}{default})"

    def usage_row(self) -> str:
        """Its row of docs/USAGE.md's settings table."""
        return f"| `{self.env}` | `{self.run_flag}` (`{self.pytest_flag}`) | {self.what} | {self.default_text} |"


OPTIONS: tuple[Option, ...] = (
    Option("impls", "impls", "--impl", "--fsdp-impl", IMPL_ENV, _parse_impls, ("reference",), "NAME",
           "implementation adapter to run cases against, repeatable or comma-separated; 'all' for every registered "
           "one", "implementations to run, comma separated; `all`", "`reference`", kind="append"),
    Option("rank_mode", "rank mode", "--rank-mode", "--fsdp-rank-mode", RANK_MODE_ENV, None, "both",
           "|".join(SELECTIONS), "process or thread ranks, both, or launched (inside a torchrun job)",
           "`process`, `thread`, `both`, or `launched` (inside a torchrun job)", "`both`", owner="harness"),
    Option("device", "device", "--device", "--fsdp-device", DEVICE_ENV, _parse_device, "auto", "auto|cpu|cuda",
           "where rows compute: CPU rows always on the CPU; GPU rows on a GPU per rank, "
           "else shared GPUs, else skipped (auto); cpu skips GPU rows; cuda requires a GPU",
           "`auto`, `cpu` or `cuda` (see [Devices and placements](#devices-and-placements))", "`auto`"),
    Option("world_size", "world size", "--world-size", "--fsdp-world-size", WORLD_SIZE_ENV, whole_number(1), None,
           "N", "process and thread ranks run every row whose case accepts N ranks at N, and skip the others with "
           "the case's requirement ('fsdp-conformance list' shows it); a launched job runs at its own size",
           "ranks every row runs on; rows whose case does not accept it are skipped with the requirement (a "
           "launched job runs at its own size)", "each case's own (`list` shows it; 2 for most)"),
    Option("timing_repeats", "timing repeats", "--timing-repeats", "--fsdp-timing-repeats", TIMING_REPEATS_ENV,
           whole_number(1), 3, "N", "timing cases (those that measure wall time, e.g. overlap/*; they run alone, "
           "after the rest) compare the median of N timings of each region with their bound, stopping early once "
           "no further timing could change the verdict: more repeats are steadier on a loaded machine and slower",
           "times a timing case repeats each timed region at most (the median counts; it stops once no further "
           "repeat could change the verdict)", "3"),
    Option("case_timeout", "case timeout", "--case-timeout", "--fsdp-case-timeout", CASE_TIMEOUT_ENV,
           whole_number(1), None, "S", "seconds every row's ranks may take before the row fails as hung, instead "
           "of each case's own timeout ('fsdp-conformance list' shows it)",
           "seconds every row's ranks may take before the row fails as hung",
           "each case's own (`list` shows it; 120 for most)"),
    Option("max_time", "max time", "--max-time", "--fsdp-max-time", MAX_TIME_ENV, whole_number(1), None, "S",
           "seconds the whole run may take: rows not started by then are reported 'not run' and the run fails",
           "seconds the run may take; rows not started by then are `not run`", "no limit"),
    Option("fuzz_examples", "fuzz examples", "--fuzz-examples", "--fsdp-fuzz-examples", FUZZ_EXAMPLES_ENV,
           whole_number(1), None, "N", "examples each fuzz row draws", "examples each fuzz row draws",
           "12, 15, 3 at world size 1, 2, 4"),
    Option("fuzz_seed", "fuzz seed", "--fuzz-seed", "--fsdp-fuzz-seed", FUZZ_SEED_ENV, whole_number(0), 0, "N",
           "the fuzzers' seed", "the fuzzers' seed", "0"),
    Option("fuzz_verbose", "fuzz verbose", "--fuzz-verbose", "--fsdp-fuzz-verbose", FUZZ_VERBOSE_ENV, _parse_flag,
           False, None, "print each fuzz example as it starts", "`1`: print each fuzz example as it starts", "0",
           kind="switch"),
    Option("fuzz_stateful_examples", "stateful fuzz examples", "--fuzz-stateful-examples",
           "--fsdp-fuzz-stateful-examples", FUZZ_STATEFUL_EXAMPLES_ENV, whole_number(1), None, "N",
           "programs each stateful fuzz row draws", "programs each stateful fuzz row draws (`fuzz/stateful_ws*`; "
           "nightly: 40)", "5, 5, 2 at world size 1, 2, 4"),
    Option("fuzz_shrink", "fuzz shrink", "--fuzz-shrink", "--fsdp-fuzz-shrink", FUZZ_SHRINK_ENV, _parse_flag, True,
           "0|1", "1: a fuzz row that finds a failure shrinks it to a smallest failing example before reporting "
           "it; 0: it reports the first failing example as drawn (the row FAILs either way; shrinking can take "
           "minutes)", "`0`: report a fuzz row's first failing example as drawn, unshrunk (the row FAILs either "
           "way)", "1"),
    Option("workers", "workers", "-n", "-n", None, word_or_whole_number(("auto",), 0), 0, "auto|N",
           "run cases on N pytest-xdist workers, timing cases alone at the end; auto fits N to the cores", "", "0, "
           "one process", owner="xdist"),
)


def usage_rows() -> list[str]:
    """docs/USAGE.md's rows for the settings with an option and a variable, in :data:`OPTIONS`' order."""
    return [option.usage_row() for option in OPTIONS if option.env is not None]
