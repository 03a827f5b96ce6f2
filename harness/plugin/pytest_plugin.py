"""pytest integration: ``@pytest.mark.ranks(...)`` runs a test body on N ranks.

    @pytest.mark.ranks(world_size=2, modes=("process", "thread"), timeout_s=60)
    def test_sum(ctx, some_fixture):
        ...

The test is parametrized over its rank modes (ids ``process`` / ``thread``,
the ``rank_mode`` parameter); the body runs on every rank through
:func:`harness.run` with the other fixture values as keyword arguments (in
process mode the ranks import the test module and call the function). A rank
failure fails the test with the rank-naming summary; a skip on every rank is
a skip. The body runs on the number of ranks the ``pytest_ranks_world_size`` hook
answers, else the marker's ``world_size``. Plugins receive every rank's return value through the
``pytest_ranks_returned`` hook (:mod:`harness.plugin.hookspecs`). The body runs
under the placement the ``pytest_ranks_placement`` hook answers, else the
marker's ``placement`` (default ``cpu``).

The rank modes are selected once per session ([Note: rank modes] in
:mod:`harness.ranks.rank_mode`) and kept in the config (:func:`rank_mode_setting`,
:func:`selected_modes`); ``--fsdp-launcher torchrun`` is a deprecated spelling of
``--fsdp-rank-mode launched``. A test is parametrized over the selected modes it
declares; when it declares none of them, over the selected ones, each
skipped with the reason (the conformance plugin reports those rows n/a).
pytest-timeout guards the parent: a marked test without its own ``timeout``
mark gets ``timeout_s`` plus :data:`POOL_START_MARGIN_S`.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
from typing import Any

import pytest

from harness.ranks.process import check_socket_path, preload_task_modules
from harness.ranks.rank_mode import SELECTIONS, SPAWNED, RankMode, excluded_reason, modes_of, resolve_selection
from harness.setting_sources import Resolved, SettingError

__all__ = ["POOL_START_MARGIN_S", "rank_mode_setting", "ranks_timeout", "selected_modes"]

POOL_START_MARGIN_S = 120.0
_RANK_MODE_KEY = pytest.StashKey[Resolved[str]]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from harness.plugin import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-harness")
    group.addoption("--fsdp-rank-mode", default=None, metavar="|".join(SELECTIONS),
                    help="process or thread ranks, both (process then thread), or launched (this process is one "
                    "rank of a job torchrun started). Default: $FSDP_RANK_MODE or both.")
    group.addoption("--fsdp-launcher", default=None, choices=("spawn", "torchrun"),
                    help="deprecated: --fsdp-launcher torchrun is --fsdp-rank-mode launched")
    parser.addini("fsdp_rank_mode", "default rank mode for @pytest.mark.ranks tests", default="both")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ranks(world_size=2, modes=('process', 'thread'), timeout_s=60, isolated=False, placement='cpu', "
        "env=None): run the test body on world_size ranks (first parameter: ctx)",
    )
    config.addinivalue_line(
        "markers", "rank_mode_excluded(reason): the row's rank mode is not one its test declares (added by the harness)"
    )
    _freeze_at_exit()
    rank_mode_setting(config)  # resolved once, early: a bad value is a usage error naming its source
    if set(selected_modes(config)) - {RankMode.LAUNCHED}:
        try:
            check_socket_path()  # every row would fail on it: say so once, before any case
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc


@functools.cache
def _freeze_at_exit() -> None:
    """Freeze this process's objects at its exit, after the exit handlers registered later
    ([Note: frozen at exit])."""
    atexit.register(gc.freeze)


# [Note: frozen at exit]
# A process that imported torch takes 0.45 to 0.8 s to end on the 2-core box: the interpreter's last
# collections walk the hundreds of thousands of objects the imports made. The processes of a session (its
# controller, each xdist worker) end one after another at the end of a run, so that is paid on the run's
# critical path. Frozen at exit (``gc.freeze()``, so the collector skips them), they end in about 0.2 s.
# What that gives up is collecting reference cycles still alive at exit, whose finalizers Python does not
# promise to run then anyway; every exit handler still runs. Rank processes and thread hosts, children of
# the forkserver, end with ``os._exit`` (multiprocessing's) and skip the interpreter's ending altogether.


def rank_mode_setting(config: pytest.Config) -> Resolved[str]:
    """This session's rank-mode selection and its source, resolved on first use and kept in the config."""
    if _RANK_MODE_KEY not in config.stash:
        cli, flag = config.getoption("--fsdp-rank-mode"), "--fsdp-rank-mode"
        if config.getoption("--fsdp-launcher") == "torchrun":
            if cli not in (None, RankMode.LAUNCHED.value):
                raise pytest.UsageError(f"--fsdp-launcher torchrun (that is, --fsdp-rank-mode launched) with "
                                        f"--fsdp-rank-mode {cli}")
            cli, flag = RankMode.LAUNCHED.value, "--fsdp-launcher torchrun"
        try:
            config.stash[_RANK_MODE_KEY] = resolve_selection(
                cli=cli, env=os.environ.get("FSDP_RANK_MODE"), ini=config.getini("fsdp_rank_mode"), cli_flag=flag)
        except SettingError as exc:
            raise pytest.UsageError(str(exc)) from exc
    return config.stash[_RANK_MODE_KEY]


def selected_modes(config: pytest.Config) -> tuple[RankMode, ...]:
    """The rank modes this session runs, in order ([Note: rank modes])."""
    return modes_of(rank_mode_setting(config).value)


class _CtxPlaceholder:
    """Stands in for ``ctx`` until the harness passes each rank its ``RankContext``."""

    def __getattr__(self, name: str) -> Any:
        raise pytest.UsageError(f"ctx.{name}: ctx is only usable in tests marked @pytest.mark.ranks")


@pytest.fixture
def ctx() -> Any:
    """Placeholder: in a ``ranks`` test the harness passes each rank's ``RankContext``."""
    return _CtxPlaceholder()


@pytest.fixture
def rank_mode(request: pytest.FixtureRequest) -> RankMode:
    return RankMode(getattr(request, "param", RankMode.PROCESS))


def _marker_kwargs(marker: pytest.Mark) -> dict[str, Any]:
    allowed = {"world_size", "modes", "timeout_s", "isolated", "placement", "env"}
    unknown = set(marker.kwargs) - allowed
    if unknown or marker.args:
        raise pytest.UsageError(f"@pytest.mark.ranks takes keywords {sorted(allowed)}; got {marker}")
    return {
        "world_size": marker.kwargs.get("world_size", 2),
        "modes": tuple(RankMode(m) for m in marker.kwargs.get("modes", SPAWNED)),
        "timeout_s": float(marker.kwargs.get("timeout_s", 60.0)),
        "isolated": bool(marker.kwargs.get("isolated", False)),
        "placement": marker.kwargs.get("placement", "cpu"),
        "env": marker.kwargs.get("env"),
    }


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("ranks")
    if marker is None:
        return
    if "ctx" not in metafunc.fixturenames:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: a ranks test's first parameter must be ctx")
    declared = _marker_kwargs(marker)["modes"]
    chosen = selected_modes(metafunc.config)
    runnable = [m for m in chosen if excluded_reason(m, declared) is None]
    params = [pytest.param(m, id=str(m), marks=() if runnable else pytest.mark.rank_mode_excluded(
        excluded_reason(m, declared))) for m in (runnable or chosen)]
    if "rank_mode" not in metafunc.fixturenames:
        metafunc.fixturenames.append("rank_mode")
    metafunc.parametrize("rank_mode", params, indirect=True)


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A row whose declared modes the selection excludes is skipped with the reason (plugins may say more)."""
    excluded = item.get_closest_marker("rank_mode_excluded")
    if excluded is not None:
        pytest.skip(excluded.args[0])


def ranks_timeout(item: pytest.Item) -> float:
    """The seconds a ``ranks`` test's ranks may take (:func:`harness.plugin.hookspecs.pytest_ranks_timeout`)."""
    answer = item.ihook.pytest_ranks_timeout(item=item)
    marker = item.get_closest_marker("ranks")
    return float(answer) if answer is not None else _marker_kwargs(marker)["timeout_s"] if marker else 60.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("ranks") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ranks_timeout(item) + POOL_START_MARGIN_S))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """The rank processes' forkserver imports the selected rank tests' modules ([Note: preloaded task modules])."""
    preload_task_modules({item.obj.__module__ for item in session.items
                          if isinstance(item, pytest.Function) and item.get_closest_marker("ranks") is not None})


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    import harness

    options = _marker_kwargs(marker)
    argnames = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in argnames if name not in ("ctx", "rank_mode")}
    values = harness.run(
        pyfuncitem.obj,
        world_size=pyfuncitem.ihook.pytest_ranks_world_size(item=pyfuncitem) or options["world_size"],
        mode=RankMode(pyfuncitem.funcargs.get("rank_mode") or pyfuncitem.callspec.params["rank_mode"]),
        placement=pyfuncitem.ihook.pytest_ranks_placement(item=pyfuncitem) or options["placement"],
        timeout_s=ranks_timeout(pyfuncitem),
        kwargs=kwargs,
        isolated=options["isolated"],
        env=options["env"],
    )
    pyfuncitem.ihook.pytest_ranks_returned(item=pyfuncitem, values=values)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Show a rank failure as its own message (rank summary first), not the harness's frames."""
    report = yield
    from harness.ranks.errors import RankFailure

    if report.failed and call.excinfo is not None and isinstance(call.excinfo.value, RankFailure):
        report.longrepr = str(call.excinfo.value)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    from harness.ranks.runner import shutdown_pools

    shutdown_pools()
