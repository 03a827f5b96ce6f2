"""Variables that only the environment gives, read where they act: their names, values and parsers.

A baseline's cache mode and log (:mod:`fixtures.baselines`) and the bench's CPU
log (:mod:`bench.cpu_probe`) are read inside rank processes or per row, long
after a session starts; a bad value found there would fail rows of the
implementation. Their readers call these functions, and so does the
conformance runner's settings resolver (``conformance.runner.settings``) when
the session is configured: a bad value is a
:class:`~harness.setting_sources.SettingError` naming the variable before any row.
(The harness's own, ``FSDP_CONCURRENT_WORKERS`` and
``FSDP_HARNESS_START_METHOD``, are resolved the same way in
:mod:`harness.ranks.cpu_budget` and :mod:`harness.ranks.process`.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from harness.setting_sources import Resolved, appendable_file, choice, resolve

__all__ = ["BASELINE_CACHE_ENV", "BASELINE_CACHE_LOG_ENV", "BASELINE_CACHE_MODES", "BENCH_CPU_LOG_ENV",
           "baseline_cache", "baseline_cache_log", "bench_cpu_log"]

#: How deterministic baselines are cached (:data:`BASELINE_CACHE_MODES`; [Note: baseline cache]).
BASELINE_CACHE_ENV = "FSDP_BASELINE_CACHE"
BASELINE_CACHE_MODES = ("on", "off", "verify")
#: A file each baseline lookup appends ``<kind> hit|miss`` to.
BASELINE_CACHE_LOG_ENV = "FSDP_BASELINE_CACHE_LOG"
#: A file each row's CPU-seconds are appended to ([Note: CPU per row]).
BENCH_CPU_LOG_ENV = "FSDP_BENCH_CPU_LOG"


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def baseline_cache(environ: Mapping[str, str] | None = None) -> Resolved[str]:
    """:data:`BASELINE_CACHE_ENV`, one of :data:`BASELINE_CACHE_MODES` (default ``on``)."""
    env = _env(environ)
    return resolve("baseline cache", [(BASELINE_CACHE_ENV, env.get(BASELINE_CACHE_ENV))],
                   choice(BASELINE_CACHE_MODES), "on")


def baseline_cache_log(environ: Mapping[str, str] | None = None) -> Resolved[str | None]:
    """:data:`BASELINE_CACHE_LOG_ENV`, a file that can be appended to (``None``: no log)."""
    env = _env(environ)
    return resolve("baseline cache log", [(BASELINE_CACHE_LOG_ENV, env.get(BASELINE_CACHE_LOG_ENV))],
                   appendable_file, None)


def bench_cpu_log(environ: Mapping[str, str] | None = None) -> Resolved[str | None]:
    """:data:`BENCH_CPU_LOG_ENV`, a file that can be appended to (``None``: not measuring)."""
    env = _env(environ)
    return resolve("bench cpu log", [(BENCH_CPU_LOG_ENV, env.get(BENCH_CPU_LOG_ENV))], appendable_file, None)
