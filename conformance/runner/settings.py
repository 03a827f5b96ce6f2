"""The conformance run's settings, each with the source it came from.

One resolver for the plugin (:func:`resolve_settings`, called once per
session at configure time; ``fsdp-conformance run`` forwards its flags to
pytest untouched). Precedence is the project's (:mod:`harness.settings`):
marker > command line > environment > default; every value is parsed by
:func:`harness.settings.choice` or :func:`harness.settings.whole_number`.

====================== ================================= =================================== ==============
setting                command line                      environment                         default
====================== ================================= =================================== ==============
implementations        ``--fsdp-impl`` / ``--impl``      ``FSDP_CONFORMANCE_IMPL`` (a,b)     reference
rank mode              ``--fsdp-rank-mode``              ``FSDP_RANK_MODE``                  both
timing repeats         ``--fsdp-timing-repeats``         ``FSDP_CONFORMANCE_TIMING_REPEATS`` 3
workers                ``-n auto|N``                     (pytest-xdist's own)                0
device                 ``--fsdp-device``                 ``FSDP_DEVICE``                     auto
fuzz examples          ``--fsdp-fuzz-examples``          ``FSDP_FUZZ_EXAMPLES``              per world size
fuzz seed              ``--fsdp-fuzz-seed``              ``FSDP_FUZZ_SEED``                  0
fuzz verbose           ``--fsdp-fuzz-verbose``           ``FSDP_FUZZ_VERBOSE`` (0|1)         0
case timeout (s)       ``--fsdp-case-timeout``           ``FSDP_CONFORMANCE_CASE_TIMEOUT``   the case's
max time (s)           ``--fsdp-max-time``               ``FSDP_CONFORMANCE_MAX_TIME``       none
stateful fuzz examples ``--fsdp-fuzz-stateful-examples`` ``FSDP_FUZZ_STATEFUL_EXAMPLES``     per world size
extra adapters                                           ``FSDP_CONFORMANCE_ADAPTERS``       none
findings files                                           ``FSDP_CONFORMANCE_FINDINGS``       none
baseline cache                                           ``FSDP_BASELINE_CACHE``             on
baseline cache log                                       ``FSDP_BASELINE_CACHE_LOG``         none
concurrent workers                                       ``FSDP_CONCURRENT_WORKERS``         xdist's
start method                                             ``FSDP_HARNESS_START_METHOD``       forkserver
bench CPU log                                            ``FSDP_BENCH_CPU_LOG``              none
====================== ================================= =================================== ==============

The settings with no option are read where they act (the adapter registry,
the findings, the baseline cache and the rank processes), each through its own
function (:mod:`harness.environment`, :mod:`harness.cpu_budget`,
:mod:`harness.process`, :mod:`conformance.contract.registry`,
:mod:`conformance.runner.findings`); :func:`resolve_settings` calls those same functions,
so every ``FSDP_*`` variable the suite reads is checked when the session is
configured, before any row runs: a bad value, a malformed adapter entry or a
findings file that does not load is a usage error naming the variable.

The rank mode is the harness's ([Note: rank modes] in :mod:`harness.rank_mode`):
its pytest plugin resolves it and this module takes that value as it is. What
a case body may read of these (timing repeats, the fuzz budget) reaches it as
the ``case_settings`` fixture, a :class:`conformance.contract.case.CaseSettings`.

A new setting is a field of :class:`Settings` resolved in :func:`resolve_settings`
with :func:`harness.settings.resolve`, plus its command-line option in the
plugin and the CLI; nothing else reads the environment for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conformance.contract import registry
from conformance.contract.case import CaseSettings
from conformance.runner import findings
from harness import cpu_budget, environment, process
from harness.devices import SETTINGS as DEVICE_SETTINGS
from harness.settings import (
    Resolved,
    SettingError,
    choice,
    resolve,
    whole_number,
    word_or_whole_number,
)

__all__ = ["IMPL_ENV", "TIMING_REPEATS_ENV", "DEVICE_ENV", "FUZZ_EXAMPLES_ENV", "FUZZ_SEED_ENV", "FUZZ_VERBOSE_ENV",
           "CASE_TIMEOUT_ENV", "MAX_TIME_ENV", "FUZZ_STATEFUL_EXAMPLES_ENV", "Settings", "SettingError",
           "environment_settings", "resolve_settings"]

IMPL_ENV = "FSDP_CONFORMANCE_IMPL"
TIMING_REPEATS_ENV = "FSDP_CONFORMANCE_TIMING_REPEATS"
DEVICE_ENV = "FSDP_DEVICE"
FUZZ_EXAMPLES_ENV = "FSDP_FUZZ_EXAMPLES"
FUZZ_SEED_ENV = "FSDP_FUZZ_SEED"
FUZZ_VERBOSE_ENV = "FSDP_FUZZ_VERBOSE"
CASE_TIMEOUT_ENV = "FSDP_CONFORMANCE_CASE_TIMEOUT"
MAX_TIME_ENV = "FSDP_CONFORMANCE_MAX_TIME"
FUZZ_STATEFUL_EXAMPLES_ENV = "FSDP_FUZZ_STATEFUL_EXAMPLES"


@dataclass(frozen=True)
class Settings:
    """Resolved settings of one run."""

    impls: Resolved[tuple[str, ...]]
    rank_mode: Resolved[str]
    timing_repeats: Resolved[int]
    workers: Resolved[int | str]
    device: Resolved[str]
    fuzz_examples: Resolved[int | None]
    fuzz_seed: Resolved[int]
    fuzz_verbose: Resolved[bool]
    #: Seconds every row's ranks may take, instead of each case's own timeout (``None``: the case's).
    case_timeout: Resolved[int | None]
    #: Seconds the run may take; rows not started by then are ``not run`` (``None``: no budget).
    max_time: Resolved[int | None]
    fuzz_stateful_examples: Resolved[int | None]
    #: The environment-only settings (module docstring), each checked here and read where it acts.
    environment: tuple[Resolved[Any], ...] = ()

    def all(self) -> tuple[Resolved[Any], ...]:
        """Every setting, in the order :meth:`describe` shows them."""
        return (self.impls, self.rank_mode, self.timing_repeats, self.workers, self.device, self.fuzz_examples,
                self.fuzz_seed, self.fuzz_verbose, self.fuzz_stateful_examples, self.case_timeout,
                self.max_time, *self.environment)

    def describe(self) -> str:
        """One line, e.g. ``impls: ('reference',) (from default); rank mode: thread (from FSDP_RANK_MODE)``."""
        return "; ".join(s.describe() for s in self.all())

    def for_cases(self) -> CaseSettings:
        """What a case body may read of them (the ``case_settings`` fixture)."""
        return CaseSettings(timing_repeats=self.timing_repeats.value, fuzz_examples=self.fuzz_examples.value,
                            fuzz_seed=self.fuzz_seed.value, fuzz_verbose=self.fuzz_verbose.value,
                            fuzz_stateful_examples=self.fuzz_stateful_examples.value)


def _parse_impls(raw: Any) -> tuple[str, ...]:
    # ``--impl a,b``, ``--impl a --impl b`` and ``FSDP_CONFORMANCE_IMPL=a,b`` all name a and b.
    names = [name for item in ([raw] if isinstance(raw, str) else raw) for name in str(item).split(",")]
    wanted = registry.expand([n.strip() for n in names if n.strip()])
    if not wanted:
        raise ValueError("names no implementation")
    known = registry.registered()
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; registered: {', '.join(sorted(known))}")
    return tuple(wanted)


_DEFAULT_FLAGS = {"impls": "--fsdp-impl", "timing_repeats": "--fsdp-timing-repeats", "workers": "-n",
                  "device": "--fsdp-device", "fuzz_examples": "--fsdp-fuzz-examples", "fuzz_seed": "--fsdp-fuzz-seed",
                  "fuzz_verbose": "--fsdp-fuzz-verbose", "case_timeout": "--fsdp-case-timeout",
                  "max_time": "--fsdp-max-time", "fuzz_stateful_examples": "--fsdp-fuzz-stateful-examples"}


def resolve_settings(
    cli: Mapping[str, tuple[str, Any]],
    *,
    rank_mode: Resolved[str],
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve every setting but the rank mode, which the harness resolved (``rank_mode``).

    ``cli`` maps a setting (``impls``, ``timing_repeats``, ``workers``, ``device``, ``fuzz_examples``,
    ``fuzz_seed``, ``fuzz_verbose``, ``fuzz_stateful_examples``, ``case_timeout``, ``max_time``) to
    ``(option as spelled, value or None)``, so errors name the
    option the user typed; ``env`` defaults to ``os.environ``. Raises :class:`SettingError` naming
    the source of a bad value.
    """
    env = os.environ if env is None else env
    environment = environment_settings(env)  # first: the implementations are looked up among the extra adapters

    def given(name: str, env_var: str | None = None) -> list[tuple[str, Any]]:
        flag, value = cli.get(name, (_DEFAULT_FLAGS[name], None))
        return [(flag, value)] + ([(env_var, env.get(env_var))] if env_var else [])

    return Settings(
        impls=resolve("impls", given("impls", IMPL_ENV), _parse_impls, ("reference",)),
        rank_mode=rank_mode,
        timing_repeats=resolve("timing repeats", given("timing_repeats", TIMING_REPEATS_ENV), whole_number(1), 3),
        workers=resolve("workers", given("workers"), word_or_whole_number(("auto",), 0), 0),
        device=resolve("device", given("device", DEVICE_ENV), choice(DEVICE_SETTINGS), "auto"),
        fuzz_examples=resolve("fuzz examples", given("fuzz_examples", FUZZ_EXAMPLES_ENV), whole_number(1), None),
        fuzz_seed=resolve("fuzz seed", given("fuzz_seed", FUZZ_SEED_ENV), whole_number(0), 0),
        fuzz_verbose=resolve("fuzz verbose", given("fuzz_verbose", FUZZ_VERBOSE_ENV), _parse_flag, False),
        case_timeout=resolve("case timeout", given("case_timeout", CASE_TIMEOUT_ENV), whole_number(1), None),
        max_time=resolve("max time", given("max_time", MAX_TIME_ENV), whole_number(1), None),
        fuzz_stateful_examples=resolve("stateful fuzz examples",
                                       given("fuzz_stateful_examples", FUZZ_STATEFUL_EXAMPLES_ENV), whole_number(1),
                                       None),
        environment=environment,
    )


def environment_settings(env: Mapping[str, str]) -> tuple[Resolved[Any], ...]:
    """The settings only a variable gives (module docstring), each resolved by the function its reader uses;
    raises :class:`SettingError` naming the variable and its bad value."""
    return (
        resolve("extra adapters", [(registry.ENV_VAR, env.get(registry.ENV_VAR))], _parse_adapters, ()),
        resolve("findings files", [(findings.ENV_VAR, env.get(findings.ENV_VAR))], findings.load_files, ()),
        environment.baseline_cache(env),
        environment.baseline_cache_log(env),
        cpu_budget.workers_setting(env),
        process.start_method_setting(env),
        environment.bench_cpu_log(env),
    )


def _parse_adapters(raw: Any) -> tuple[str, ...]:
    """``FSDP_CONFORMANCE_ADAPTERS``'s entries as given, each checked (:func:`registry.parse_entries`)."""
    return tuple(f"{entry.name}={entry.target}" for entry in registry.parse_entries(str(raw)))


def _parse_flag(raw: Any) -> bool:
    """``True``/``1`` or ``False``/``0`` (a command-line switch gives the bool itself)."""
    if isinstance(raw, bool):
        return raw
    return choice(("0", "1"))(raw) == "1"
