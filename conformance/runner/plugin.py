"""pytest plugin: parametrize cases over implementations and collect the matrix.

Loaded with the suite's other plugins by ``-p conformance.pytest_plugin``
([Note: opt-in plugins]), so ``pytest conformance/cases --fsdp-impl torch-fsdp2``
works without the CLI; the CLI
(:mod:`conformance.runner.cli`) is a thin layer that adds options and calls
``pytest.main``.

Settings (implementations, rank mode, timing repeats, device) come from
:func:`conformance.runner.settings.resolve_settings`, which states the precedence.
Each row's placement is decided in the parent before its ranks start
(:func:`harness.ranks.devices.decide`, from the device setting, the GPUs visible
and the case's ``gpus`` need), handed to the harness through its
``pytest_ranks_placement`` hook, and recorded in the row's result.
The plugin meets the harness's plugin through declared hooks: it implements
``pytest_ranks_returned`` (:mod:`harness.plugin.hookspecs`) to receive a case's
:class:`~conformance.contract.results.CaseReport`, and calls
``pytest_conformance_result`` (:mod:`conformance.runner.hookspecs`) once per cell.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from conformance.contract import registry
from conformance.contract.applicability import not_applicable_reason
from conformance.contract.case import CaseSettings, NotApplicable
from conformance.contract.declared import DeclaredAdapter
from conformance.contract.optional import capabilities_of
from conformance.contract.results import CaseReport, Result
from conformance.contract.rows import all_params, case_row_id, case_spec
from conformance.runner import baseline, budget, outputs, progress, world_sizes
from conformance.runner.findings import Finding, annotate, explaining, registered_for
from conformance.runner.options import OPTIONS
from conformance.runner.reasons import failure_reason, skip_reason
from conformance.runner.report import summary_line
from conformance.runner.settings import Settings, resolve_settings
from conformance.runner.terminal import render_terminal, terminal_width
from harness.plugin.pytest_plugin import rank_mode_setting, selected_modes
from harness.plugin.workers import is_worker
from harness.ranks import devices
from harness.ranks.rank_mode import RankMode

__all__ = ["RESULTS_KEY", "SELECTED_KEY", "SETTINGS_KEY", "settings_of"]

RESULTS_KEY = pytest.StashKey[list[Result]]()
SETTINGS_KEY = pytest.StashKey[Settings]()
#: The cells this session selected (under -n, the controller learns it from its workers: transport).
SELECTED_KEY = pytest.StashKey[int]()
_GPUS_KEY = pytest.StashKey[int]()
_STATE_KEY = pytest.StashKey["_ItemState"]()
_SESSION_KEY = pytest.StashKey[pytest.Session]()
_ADAPTERS_KEY = pytest.StashKey[list[Any]]()


@dataclass
class _ItemState:
    outcome: str = "pass"
    reason: str = ""
    started: float = field(default_factory=time.perf_counter)
    report: CaseReport | None = None
    placement: str = ""
    #: The ranks the row runs on ([Note: world sizes]); a row that does not run keeps its case's default.
    world_size: int = 0
    #: The skip raised is the plugin's own: missing hardware, or a world size the case does not accept.
    own_skip: bool = False
    #: The registered finding that explains the row's failure, if one does.
    finding: Finding | None = None
    #: How a launched job ran a row smaller than itself, added to the row's reason ([Note: world sizes]).
    size_note: str = ""


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from conformance.runner import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-conformance")
    for option in OPTIONS:  # [Note: one table of options]
        if option.owner != "suite":
            continue
        if option.kind == "switch":
            group.addoption(option.pytest_flag, action="store_true", default=None, help=option.help_text())
        else:
            group.addoption(option.pytest_flag, action="append" if option.kind == "append" else "store",
                            default=None, metavar=option.metavar, help=option.help_text())
    group.addoption("--conformance-json", metavar="PATH", help="write the run's JSON report (docs/REPORTS.md)")
    group.addoption("--conformance-markdown", metavar="PATH", help="write the matrix as markdown")
    group.addoption("--conformance-junit", metavar="PATH", help="write JUnit XML, one testcase per row")
    group.addoption("--conformance-html", metavar="PATH", help="write the matrix as one self-contained HTML page")
    group.addoption("--conformance-progress", action="store_true",
                    help="print one line per case as it finishes and the matrix at the end")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance(spec): a conformance case (added by conformance.contract.case)")
    config.addinivalue_line("markers", "gpu: a GPU row or a mutant only GPUs expose; skipped with the reason "
                            "without a GPU, run by `tox -e gpu`")
    config.stash[RESULTS_KEY] = []
    try:  # a bad value is a usage error before collection, naming its source
        cli = {option.name: (option.pytest_flag, config.getoption(option.pytest_flag))
               for option in OPTIONS if option.owner == "suite"}
        cli["workers"] = ("-n", config.getoption("numprocesses", None))  # pytest-xdist's option
        config.stash[SETTINGS_KEY] = resolve_settings(cli, rank_mode=rank_mode_setting(config))
        if launched(config) and config.stash[SETTINGS_KEY].workers.value != 0:
            raise ValueError(f"-n {config.stash[SETTINGS_KEY].workers.value} with launched ranks: a launched "
                             "job's ranks run every case in lockstep; leave -n out")
        if launched(config):
            world_sizes.check_launched_size(config.stash[SETTINGS_KEY], os.environ.get("WORLD_SIZE"))
        device = config.stash[SETTINGS_KEY].device
        config.stash[_GPUS_KEY] = devices.visible_gpus() if device.value != "cpu" else 0
        devices.check_setting(device.value, device.source, config.stash[_GPUS_KEY])
        if reports_here(config):  # report paths checked and claimed before any case runs
            outputs.prepare(config)
        budget.start(config, config.stash[SETTINGS_KEY].max_time.value)
    except ValueError as exc:  # SettingError included
        raise pytest.UsageError(str(exc)) from exc


def pytest_unconfigure(config: pytest.Config) -> None:
    outputs.release(config)


def settings_of(config: pytest.Config) -> Settings:
    """The settings this session resolved at configure time."""
    return config.stash[SETTINGS_KEY]


def launched(config: pytest.Config) -> bool:
    """Whether this session is one rank of a launched job ([Note: rank modes] in :mod:`harness.ranks.rank_mode`)."""
    return RankMode.LAUNCHED in selected_modes(config)


def reports_here(config: pytest.Config) -> bool:
    """Whether this process prints the matrix and writes reports: not an xdist worker, and of a launched
    job only rank 0 (every rank decides the same cells; they are exchanged per case)."""
    return not is_worker(config) and (not launched(config) or os.environ.get("RANK", "0") == "0")


def pytest_report_header(config: pytest.Config) -> str:
    return f"fsdp-conformance: {settings_of(config).describe()}"


def pytest_sessionstart(session: pytest.Session) -> None:
    """With progress lines, the settings and their sources first (pytest's header is hidden by -q)."""
    session.config.stash[_SESSION_KEY] = session
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if session.config.getoption("--conformance-progress") and reports_here(session.config) and reporter is not None:
        reporter.write_line(f"fsdp-conformance: {settings_of(session.config).describe()}")


@pytest.fixture
def case_settings(request: pytest.FixtureRequest) -> CaseSettings:
    """The run's settings a case body may read (timing repeats, the fuzz budget, its row's findings)."""
    return replace(settings_of(request.config).for_cases(), known_failures=registered_for(request.node))


@pytest.hookimpl
def pytest_ranks_timeout(item: pytest.Item) -> float | None:
    """A conformance row's timeout: its case's, under this run's settings."""
    spec, settings = case_spec(item), settings_of(item.config)
    if spec is None:
        return None
    return settings.case_timeout.value or spec.timeout(settings.for_cases())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" not in metafunc.fixturenames or metafunc.definition.get_closest_marker("conformance") is None:
        return
    adapters = _adapters(metafunc.config)
    metafunc.parametrize("impl", adapters, ids=[a.name for a in adapters])


def _adapters(config: pytest.Config) -> list[Any]:
    """The run's adapters, loaded once per session (every case's rows share them); one that fails to load
    stands in as :class:`_Unloadable`, reported per row as an error."""
    if _ADAPTERS_KEY not in config.stash:
        adapters: list[Any] = []
        for name in settings_of(config).impls.value:
            try:
                adapters.append(registry.load(name))
            except Exception as exc:  # noqa: BLE001 - reported per case as an error row
                adapters.append(_Unloadable(name, f"{type(exc).__name__}: {exc}"))
        config.stash[_ADAPTERS_KEY] = adapters
    return config.stash[_ADAPTERS_KEY]


@dataclass(frozen=True)
class _Unloadable:
    """Stands in for an adapter whose module failed to import."""

    name: str
    error: str


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    spec = case_spec(item)
    if spec is None:
        return
    size = world_sizes.row_world_size(spec, all_params(item), settings_of(item.config), launched=launched(item.config))
    state = item.stash[_STATE_KEY] = _ItemState(world_size=size.size or spec.need_for(all_params(item)).default,
                                                size_note=size.note)
    spent = budget.not_run_reason(item.config)
    if spent is not None:
        raise budget.NotRun(spent)
    impl = all_params(item).get("impl")
    if impl is None:
        raise pytest.UsageError(f"{item.nodeid}: a conformance case must take the impl parameter")
    if isinstance(impl, _Unloadable):
        pytest.fail(f"adapter {impl.name!r} failed to load: {impl.error}", pytrace=False)
    reason = impl.unavailable_reason()
    if reason is not None:
        pytest.fail(f"adapter {impl.name!r} is unavailable: {reason}", pytrace=False)
    decision = devices.decide(setting=settings_of(item.config).device.value, gpus=item.config.stash[_GPUS_KEY],
                              world_size=state.world_size, need=spec.gpus_for(all_params(item)),
                              nccl=devices.nccl_available())  # where the row runs: [Note: device setting]
    state.placement = decision.placement or ""
    not_applicable = not_applicable_reason(spec, impl, all_params(item))
    if not_applicable is not None:
        raise NotApplicable(not_applicable)
    if size.size is None or decision.placement is None:
        state.own_skip = True
        pytest.skip(decision.reason if decision.placement is None else size.reason)  # missing hardware first


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the GPU rows of cases whose ``gpus`` is a function of the grid (before ``-m gpu`` selects)."""
    for item in items:
        spec = case_spec(item)
        if spec is not None and callable(spec.gpus) and spec.gpus_for(all_params(item)) is not None:
            item.add_marker(pytest.mark.gpu)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Count the selected cells, so a report can tell a complete run from one that ended early."""
    session.config.stash[SELECTED_KEY] = sum(1 for item in session.items if case_spec(item) is not None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Hand the body its adapter behind the row's declaration ([Note: requirements are checked once])."""
    spec = case_spec(item)
    funcargs = getattr(item, "funcargs", None)
    if spec is None or funcargs is None or "impl" not in funcargs:
        return
    impl = funcargs["impl"]
    params = all_params(item)
    funcargs["impl"] = DeclaredAdapter(impl, spec.permitted(params, capabilities_of(impl)), spec.id,
                                       strategies=spec.strategies_for(params))


@pytest.hookimpl
def pytest_ranks_world_size(item: pytest.Item) -> int | None:
    """The world size decided for a conformance row in setup; other tests keep their marker's."""
    state = item.stash.get(_STATE_KEY, None)
    return (state.world_size or None) if state is not None else None


@pytest.hookimpl
def pytest_ranks_placement(item: pytest.Item) -> str | None:
    """The placement planned for a conformance row in setup; other tests keep the harness default."""
    state = item.stash.get(_STATE_KEY, None)
    return (state.placement or None) if state is not None else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    state = item.stash.get(_STATE_KEY, None)
    if state is None or state.outcome != "pass":
        return report
    if report.failed:
        state.outcome = "FAIL" if report.when == "call" else "error"
        state.reason = failure_reason(call, report)
        if state.outcome == "FAIL":
            _explain(item, state, report)
    elif report.skipped:
        excinfo = call.excinfo
        message = getattr(excinfo.value, "msg", None) if excinfo is not None else None
        reason = str(message) if message else skip_reason(report)
        if excinfo is not None and isinstance(excinfo.value, NotApplicable):
            state.outcome, state.reason = "n/a", reason
        elif excinfo is not None and isinstance(excinfo.value, budget.NotRun):
            state.outcome, state.reason = "not run", reason
        elif state.own_skip or launched(item.config):
            state.outcome, state.reason = "skip", reason  # missing hardware, the world size, a launched rank's GPU
        else:
            state.outcome = "error"
            state.reason = f"skipped, but skip means missing hardware (use not_applicable() for n/a): {reason}"
            report.outcome, report.longrepr = "failed", state.reason
    return report


def _explain(item: pytest.Item, state: _ItemState, report: pytest.TestReport) -> None:
    """Look up the finding that explains the row's FAIL; one of kind ``documented`` makes the cell
    "documented", which pytest reports as a skip: the implementation does what its documentation says."""
    impl_name = getattr(all_params(item).get("impl"), "name", "?")
    state.finding = explaining(impl_name, case_row_id(item), state.reason)
    if state.finding is not None and state.finding.kind == "documented":
        state.outcome = "documented"
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"documented: {state.finding.documentation}")


@pytest.hookimpl
def pytest_ranks_returned(item: pytest.Item, values: list[Any]) -> None:
    """Keep rank 0's :class:`CaseReport`; any other non-``None`` return value is a mistake in the case."""
    state = item.stash.get(_STATE_KEY, None)
    if state is None or not values:
        return
    value = values[0]
    if value is not None and not isinstance(value, CaseReport):
        raise TypeError(
            f"{case_row_id(item)} returned {type(value).__name__}; a case returns None or "
            f"conformance.contract.results.CaseReport(reason=..., metrics=...)"
        )
    state.report = value


def pytest_runtest_teardown(item: pytest.Item) -> None:
    state = item.stash.get(_STATE_KEY, None)
    spec = case_spec(item)
    if state is None or spec is None:
        return
    params = all_params(item)
    impl_name = getattr(params.get("impl"), "name", "?")
    case_id = case_row_id(item)
    reason = state.reason
    if state.outcome == "pass" and state.report is not None and state.report.reason:
        reason = state.report.reason
    if state.size_note and state.outcome not in ("skip", "n/a", "not run"):
        reason = f"{reason}; {state.size_note}" if reason else state.size_note
    finding = state.finding
    result = Result(
        case=case_id,
        impl=impl_name,
        rank_mode=str(params["rank_mode"]),
        world_size=state.world_size,
        outcome=state.outcome,
        reason=annotate(impl_name, case_id, reason, finding) if finding is not None else reason,
        duration_s=round(time.perf_counter() - state.started, 3),
        metrics=dict(state.report.metrics) if state.report is not None else {},
        placement=state.placement,
        finding=finding.doc if finding is not None else "",
    )
    item.config.hook.pytest_conformance_result(config=item.config, result=result)


@pytest.hookimpl
def pytest_conformance_result(config: pytest.Config, result: Result) -> None:
    """Add the cell to the matrix; with ``--conformance-progress`` print its line."""
    config.stash[RESULTS_KEY].append(result)
    if config.getoption("--conformance-progress") and reports_here(config):
        progress.write_line(config, progress.line(config, len(config.stash[RESULTS_KEY]), result))


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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Any differences from a baseline, the matrix and the report files; under ``-n`` only the controller, which
    has every result. An interrupted run gets here too ([Note: stop signals]); its reports say so."""
    results = config.stash.get(RESULTS_KEY, [])
    comparison = baseline.show(terminalreporter, results, config.stash.get(SELECTED_KEY, None), reports_here(config))
    if not reports_here(config):
        return
    if results and config.getoption("--conformance-progress"):
        terminalreporter.write_sep("=", "conformance matrix")
        terminalreporter.write_line(render_terminal(results, terminal_width()))
        terminalreporter.write_line(summary_line(results))
    failures = outputs.write(config, results, settings=settings_of(config), gpus=config.stash[_GPUS_KEY],
                             exitstatus=exitstatus, selected=config.stash.get(SELECTED_KEY, None),
                             expectation=comparison)
    for message in failures:
        terminalreporter.write_line(message, red=True)
    if failures:  # exit code: internal error (a report that was asked for is missing)
        config.stash[_SESSION_KEY].exitstatus = pytest.ExitCode.INTERNAL_ERROR
