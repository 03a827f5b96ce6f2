"""pytest plugin: parametrize cases over implementations and collect the matrix.

Registered as the ``fsdp_conformance`` pytest11 entry point, so
``pytest conformance --fsdp-impl torch-fsdp2`` works without the CLI; the CLI
(:mod:`conformance.cli`) is a thin layer that adds options and calls
``pytest.main``.

Settings precedence, stated once: command-line option > environment variable
(``FSDP_CONFORMANCE_IMPL``, comma separated) > default (``reference``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conformance import registry
from conformance.case import CaseSpec, NotApplicable, hardware_skip_reason
from conformance.findings import annotate
from conformance.report import Result, render_markdown, render_matrix, summary_line, write_json

__all__ = ["RESULTS_KEY"]

RESULTS_KEY = pytest.StashKey[list[Result]]()
_STATE_KEY = pytest.StashKey["_ItemState"]()
_RANK_MODE_PARAMS = ("rank_mode",)


@dataclass
class _ItemState:
    outcome: str = "pass"
    reason: str = ""
    started: float = field(default_factory=time.perf_counter)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-conformance")
    group.addoption(
        "--fsdp-impl",
        action="append",
        default=None,
        metavar="NAME",
        help="implementation adapter to run cases against (repeatable; 'all' = every registered "
        "adapter). Default: $FSDP_CONFORMANCE_IMPL or 'reference'.",
    )
    group.addoption("--conformance-json", metavar="PATH", help="write the results as JSON")
    group.addoption("--conformance-markdown", metavar="PATH", help="write the matrix as markdown")
    group.addoption(
        "--conformance-progress",
        action="store_true",
        help="print one line per case as it finishes and the matrix at the end",
    )
    group.addoption(
        "--timing-repeats",
        type=int,
        default=3,
        metavar="N",
        help="repetitions of each timed region in overlap cases (median is used)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "conformance(spec): a conformance case (added by conformance.case)"
    )
    config.stash[RESULTS_KEY] = []
    # Case bodies run in rank processes; the repeat count reaches them through the environment.
    os.environ["FSDP_CONFORMANCE_TIMING_REPEATS"] = str(config.getoption("--timing-repeats"))
    selected_impls(config)  # a bad --fsdp-impl is a usage error before collection


def selected_impls(config: pytest.Config) -> list[str]:
    names = config.getoption("--fsdp-impl")
    if not names:
        env = os.environ.get("FSDP_CONFORMANCE_IMPL", "")
        names = [n.strip() for n in env.split(",") if n.strip()] or ["reference"]
    names = registry.expand(list(names))
    known = registry.registered()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise pytest.UsageError(
            f"--fsdp-impl: unknown implementation(s) {unknown}; registered: {', '.join(sorted(known))}"
        )
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" not in metafunc.fixturenames or metafunc.definition.get_closest_marker("conformance") is None:
        return
    adapters: list[Any] = []
    for name in selected_impls(metafunc.config):
        try:
            adapters.append(registry.load(name))
        except Exception as exc:  # noqa: BLE001 - reported per case as an error row
            adapters.append(_Unloadable(name, f"{type(exc).__name__}: {exc}"))
    metafunc.parametrize("impl", adapters, ids=[a.name for a in adapters])


@dataclass(frozen=True)
class _Unloadable:
    """Stands in for an adapter whose module failed to import."""

    name: str
    error: str


def _spec(item: pytest.Item) -> CaseSpec | None:
    marker = item.get_closest_marker("conformance")
    return None if marker is None else marker.args[0]


def _params(item: pytest.Item) -> dict[str, Any]:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    spec = _spec(item)
    if spec is None:
        return
    item.stash[_STATE_KEY] = _ItemState()
    impl = _params(item).get("impl")
    if impl is None:
        raise pytest.UsageError(f"{item.nodeid}: a conformance case must take the impl parameter")
    if isinstance(impl, _Unloadable):
        pytest.fail(f"adapter {impl.name!r} failed to load: {impl.error}", pytrace=False)
    reason = impl.unavailable_reason()
    if reason is not None:
        pytest.fail(f"adapter {impl.name!r} is unavailable: {reason}", pytrace=False)
    missing = [str(c) for c in spec.required(_params(item)) if c not in impl.capabilities]
    if missing:
        raise NotApplicable(f"{impl.name} lacks capability {', '.join(missing)}")
    hardware = hardware_skip_reason(spec)
    if hardware is not None:
        pytest.skip(hardware)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    state = item.stash.get(_STATE_KEY, None)
    if state is None or state.outcome != "pass":
        return report
    if report.failed:
        state.outcome = "FAIL" if report.when == "call" else "error"
        state.reason = _failure_reason(call, report)
    elif report.skipped:
        excinfo = call.excinfo
        not_app = excinfo is not None and isinstance(excinfo.value, NotApplicable)
        state.outcome = "n/a" if not_app else "skip"
        message = getattr(excinfo.value, "msg", None) if excinfo is not None else None
        state.reason = str(message) if message else _skip_reason(report)
    return report


def pytest_runtest_teardown(item: pytest.Item) -> None:
    state = item.stash.get(_STATE_KEY, None)
    spec = _spec(item)
    if state is None or spec is None:
        return
    params = _params(item)
    impl = params.pop("impl", None)
    mode = next((params.pop(k) for k in _RANK_MODE_PARAMS if k in params), "process")
    label = "-".join(str(v) for v in params.values())
    case_id = f"{spec.id}[{label}]" if label else spec.id
    reported = _reported(item)
    if state.outcome == "pass" and reported.get("reason"):
        state.reason = str(reported["reason"])
    result = Result(
        case=case_id,
        impl=getattr(impl, "name", "?"),
        rank_mode=str(mode),
        world_size=spec.world_size,
        outcome=state.outcome,
        reason=annotate(getattr(impl, "name", "?"), case_id, state.reason) if state.outcome == "FAIL" else state.reason,
        duration_s=round(time.perf_counter() - state.started, 3),
        metrics=dict(reported.get("metrics", {})),
    )
    item.config.stash[RESULTS_KEY].append(result)
    if item.config.getoption("--conformance-progress"):
        done = len(item.config.stash[RESULTS_KEY])
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"[{done:4d}] {result.outcome:5s} {result.case}  {result.impl}/{result.rank_mode}"
                f"  {result.duration_s:.2f}s" + (f"  ({result.reason})" if result.reason else "")
            )


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> Any:
    """Silence pytest's own progress characters when the plugin prints lines."""
    if not config.getoption("--conformance-progress"):
        return None
    category: str
    if report.when == "call":
        category = report.outcome
    elif report.failed:
        category = "error"
    elif report.skipped:
        category = "skipped"
    else:
        return None
    return category, "", category.upper()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS_KEY, [])
    if not results:
        return
    if config.getoption("--conformance-progress"):
        terminalreporter.write_sep("=", "conformance matrix")
        terminalreporter.write_line(render_matrix(results))
        terminalreporter.write_line(summary_line(results))
    json_path = config.getoption("--conformance-json")
    if json_path:
        write_json(results, Path(json_path))
    md_path = config.getoption("--conformance-markdown")
    if md_path:
        Path(md_path).parent.mkdir(parents=True, exist_ok=True)
        Path(md_path).write_text(render_markdown(results))


def _reported(item: pytest.Item) -> dict[str, Any]:
    """What rank 0's case body returned, when it returned a dict (reason, metrics)."""
    from harness.pytest_plugin import RANK_VALUES

    values = item.stash.get(RANK_VALUES, None)
    return values[0] if values and isinstance(values[0], dict) else {}


def _failure_reason(call: pytest.CallInfo[None], report: pytest.TestReport) -> str:
    """First line of the failure; a rank failure's own summary already names the rank."""
    from harness.errors import RankFailure

    if call.excinfo is None:
        return _first_line(report.longreprtext)
    if isinstance(call.excinfo.value, RankFailure):
        return _first_line(str(call.excinfo.value))
    return _first_line(call.excinfo.exconly())


def _first_line(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line[:400]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return _first_line(str(longrepr))
