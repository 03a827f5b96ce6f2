"""The conformance run's settings, each with the source it came from.

One resolver for the plugin (:func:`resolve_settings`, called once per
session at configure time; ``fsdp-conformance run`` forwards its flags to
pytest untouched). Precedence is the project's (:mod:`harness.setting_sources`):
marker > command line > environment > default; every value is parsed by
:func:`harness.setting_sources.choice` or :func:`harness.setting_sources.whole_number`.

Every setting with a command-line option is an entry of
:data:`conformance.runner.options.OPTIONS` ([Note: one table of options]);
:func:`resolve_settings` resolves each with its parser, default and variable.
The rank mode is the harness's: its plugin resolves it and this module takes
that value as it is.

The settings with no option (:func:`environment_settings`: extra adapters,
findings files, the baseline cache and its log, concurrent workers, the rank
processes' start method, the benchmarks' CPU log) are read where they act,
each through its own function (:mod:`harness.environment`,
:mod:`harness.ranks.cpu_budget`, :mod:`harness.ranks.process`,
:mod:`conformance.contract.registry`, :mod:`conformance.runner.findings`);
:func:`resolve_settings` calls those same functions, so every ``FSDP_*``
variable the suite reads is checked when the session is configured, before
any row runs: a bad value, a malformed adapter entry or a findings file that
does not load is a usage error naming the variable.

What a case body may read of these (timing repeats, the fuzz budget) reaches
it as the ``case_settings`` fixture, a
:class:`conformance.contract.case.CaseSettings`. A new setting is an
:class:`~conformance.runner.options.Option` and a field of :class:`Settings`;
nothing else reads the environment for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conformance.contract import registry
from conformance.contract.case import CaseSettings
from conformance.runner import findings
from conformance.runner.options import (
    CASE_TIMEOUT_ENV,
    DEVICE_ENV,
    FUZZ_EXAMPLES_ENV,
    FUZZ_SEED_ENV,
    FUZZ_SHRINK_ENV,
    FUZZ_STATEFUL_EXAMPLES_ENV,
    FUZZ_VERBOSE_ENV,
    IMPL_ENV,
    MAX_TIME_ENV,
    OPTIONS,
    TIMING_REPEATS_ENV,
)
from harness import environment
from harness.ranks import cpu_budget, process
from harness.setting_sources import (
    Resolved,
    SettingError,
    resolve,
)

__all__ = ["IMPL_ENV", "TIMING_REPEATS_ENV", "DEVICE_ENV", "FUZZ_EXAMPLES_ENV", "FUZZ_SEED_ENV", "FUZZ_SHRINK_ENV",
           "FUZZ_VERBOSE_ENV", "CASE_TIMEOUT_ENV", "MAX_TIME_ENV", "FUZZ_STATEFUL_EXAMPLES_ENV", "Settings",
           "SettingError", "environment_settings", "resolve_settings"]

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
    #: Whether a fuzz row shrinks the failure it found before reporting it.
    fuzz_shrink: Resolved[bool]
    #: The ranks process and thread rows run on (``None``: each case's default; [Note: world sizes]).
    world_size: Resolved[int | None]
    #: The environment-only settings (module docstring), each checked here and read where it acts.
    environment: tuple[Resolved[Any], ...] = ()

    def all(self) -> tuple[Resolved[Any], ...]:
        """Every setting, in the order :meth:`describe` shows them."""
        return (self.impls, self.rank_mode, self.world_size, self.timing_repeats, self.workers, self.device,
                self.fuzz_examples, self.fuzz_seed, self.fuzz_verbose, self.fuzz_stateful_examples, self.fuzz_shrink,
                self.case_timeout, self.max_time, *self.environment)

    def describe(self) -> str:
        """One line, e.g. ``impls: ('reference',) (from default); rank mode: thread (from FSDP_RANK_MODE)``."""
        return "; ".join(s.describe() for s in self.all())

    def for_cases(self) -> CaseSettings:
        """What a case body may read of them (the ``case_settings`` fixture)."""
        return CaseSettings(timing_repeats=self.timing_repeats.value, fuzz_examples=self.fuzz_examples.value,
                            fuzz_seed=self.fuzz_seed.value, fuzz_verbose=self.fuzz_verbose.value,
                            fuzz_stateful_examples=self.fuzz_stateful_examples.value,
                            fuzz_shrink=self.fuzz_shrink.value)


def resolve_settings(
    cli: Mapping[str, tuple[str, Any]],
    *,
    rank_mode: Resolved[str],
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve every setting but the rank mode, which the harness resolved (``rank_mode``).

    ``cli`` maps a setting (``impls``, ``world_size``, ``timing_repeats``, ``workers``, ``device``, ``fuzz_examples``,
    ``fuzz_seed``, ``fuzz_verbose``, ``fuzz_stateful_examples``, ``fuzz_shrink``, ``case_timeout``, ``max_time``) to
    ``(option as spelled, value or None)``, so errors name the
    option the user typed; ``env`` defaults to ``os.environ``. Raises :class:`SettingError` naming
    the source of a bad value.
    """
    env = os.environ if env is None else env
    environment = environment_settings(env)  # first: the implementations are looked up among the extra adapters
    values = {}
    for option in OPTIONS:
        if option.parse is None:
            continue  # the harness's (the rank mode)
        flag, value = cli.get(option.name, (option.pytest_flag, None))
        given = [(flag, value)] + ([(option.env, env.get(option.env))] if option.env else [])
        values[option.name] = resolve(option.label, given, option.parse, option.default)
    return Settings(rank_mode=rank_mode, environment=environment, **values)


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
