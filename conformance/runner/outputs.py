"""The report files a run was asked for: claimed before the first case, written at the end.

:func:`prepare` runs at configure time in the process that reports (the
xdist controller; rank 0 of a launched job): it checks and locks every path
([Note: report files] in :mod:`conformance.runner.atomic`). :func:`write`
runs at the end of the session, whether it finished or was stopped
([Note: stop signals] in :mod:`conformance.runner.signals`), and writes each
report atomically, marked interrupted when it was. Formats: ``docs/REPORTS.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.contract.results import Result
from conformance.runner import signals
from conformance.runner.atomic import ReportLock, check_path, write_atomic
from conformance.runner.document import RunFacts, machine_facts, now, render_json
from conformance.runner.expect import Comparison
from conformance.runner.html_report import render_html
from conformance.runner.junit import render_junit
from conformance.runner.report import render_markdown
from conformance.runner.settings import Settings
from conformance.runner.versions import adapter_facts

__all__ = ["OPTIONS", "prepare", "release", "requested", "write"]

#: Report kind -> the pytest option that asks for it (``fsdp-conformance run``: --json, --markdown, --junitxml,
#: --html).
OPTIONS = {"JSON": "--conformance-json", "markdown": "--conformance-markdown", "JUnit": "--conformance-junit",
           "HTML": "--conformance-html"}


@dataclass
class _Claim:
    paths: dict[str, Path]
    locks: list[ReportLock]
    started_at: str


_CLAIM_KEY = pytest.StashKey[_Claim]()


def requested(config: pytest.Config) -> dict[str, Path]:
    """Report kind -> path, for each report this session was asked for."""
    return {kind: Path(value) for kind, option in OPTIONS.items() if (value := config.getoption(option, None))}


def prepare(config: pytest.Config) -> None:
    """Check and lock every requested path; ``ValueError`` (a usage error) names the first bad one."""
    paths = requested(config)
    seen: dict[Path, str] = {}
    for kind, path in paths.items():
        other = seen.setdefault(path.resolve(), kind)
        if other != kind:
            raise ValueError(f"the {other} and {kind} reports are both asked for at {path}; give each its own path")
        check_path(path, f"{kind} report")
    locks: list[ReportLock] = []
    try:
        for kind, path in paths.items():
            locks.append(ReportLock(path, f"{kind} report"))
    except ValueError:
        for lock in locks:
            lock.release()
        raise
    config.stash[_CLAIM_KEY] = _Claim(paths, locks, now())


def release(config: pytest.Config) -> None:
    """Drop this run's locks (at unconfigure; idempotent)."""
    claim = config.stash.get(_CLAIM_KEY, None)
    for lock in claim.locks if claim is not None else ():
        lock.release()


def _facts(config: pytest.Config, settings: Settings, gpus: int, exitstatus: int, selected: int | None,
           expectation: Comparison | None) -> RunFacts:
    from harness.ranks.devices import nccl_available

    stopped = signals.received() or ("interrupted" if exitstatus == pytest.ExitCode.INTERRUPTED else None)
    if exitstatus in (pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR):
        selected = None  # the session failed: whatever it counted, it cannot vouch for its rows
    return RunFacts(started_at=config.stash[_CLAIM_KEY].started_at, ended_at=now(),
                    settings={s.name.replace(" ", "_"): {"value": s.value, "source": s.source} for s in settings.all()},
                    machine=machine_facts(gpus, nccl_available()), interrupted_by=stopped, selected_rows=selected,
                    adapters=adapter_facts(settings.impls.value), expectation=expectation,
                    topology=_topology(settings))


def _topology(settings: Settings) -> dict[str, int] | None:
    """The launched job's ``nodes x local ranks`` ([Note: job layout] in :mod:`harness.ranks.launched`), else
    ``None``."""
    if settings.rank_mode.value != "launched":
        return None
    from harness.ranks.launched import job_layout

    layout = job_layout()
    return {name: layout[name] for name in ("nodes", "local_world_size", "world_size")}


def _markdown(results: Sequence[Result], facts: RunFacts) -> str:
    text = render_markdown(results)
    if facts.interrupted_by is not None:
        return (f"> **Interrupted** ({facts.interrupted_by}) after {len(results)} rows: rows not listed did not "
                "run.\n\n" + text)
    reason = facts.incomplete_reason(len(results))
    return text if reason is None else f"> **Incomplete**: {reason}.\n\n" + text


_RENDERERS = {"JSON": render_json, "markdown": _markdown, "JUnit": render_junit, "HTML": render_html}


def write(config: pytest.Config, results: Sequence[Result], *, settings: Settings, gpus: int,
          exitstatus: int, selected: int | None = None, expectation: Comparison | None = None) -> list[str]:
    """Write every requested report, each with ``expectation`` (the comparison with ``--conformance-expect``'s
    baseline) when given; the messages of those that could not be written (their old files kept)."""
    claim = config.stash.get(_CLAIM_KEY, None)
    if claim is None or not claim.paths:
        return []
    facts = _facts(config, settings, gpus, exitstatus, selected, expectation)
    failures = []
    for kind, path in claim.paths.items():
        try:
            text = render_html(results, facts, path.parent) if kind == "HTML" else _RENDERERS[kind](results, facts)
            write_atomic(path, text)
        except OSError as exc:
            failures.append(f"fsdp-conformance: could not write the {kind} report to {path} ({exc}); "
                            "the file that was there, if any, is unchanged")
    return failures
