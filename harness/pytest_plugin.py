"""pytest integration: ``@pytest.mark.ranks(...)`` runs a test body on N ranks.

    @pytest.mark.ranks(world_size=2, modes=("process", "thread"), timeout_s=60)
    def test_sum(ctx, some_fixture):
        ...

The test is parametrized over its rank modes (ids ``process`` / ``thread``,
the ``rank_mode`` parameter); the body runs on every rank through
:func:`harness.run` with the other fixture values as keyword arguments (in
process mode the ranks import the test module and call the function). A rank
failure fails the test with the rank-naming summary; a skip on every rank is
a skip. Plugins receive every rank's return value through the
``pytest_ranks_returned`` hook (:mod:`harness.hookspecs`). The body runs
under the placement the ``pytest_ranks_placement`` hook answers, else the
marker's ``placement`` (default ``cpu``).

Rank-mode selection, stated once: the marker's ``modes`` bound what a test
*can* run under; within that, the command line ``--rank-mode`` wins over the
``FSDP_RANK_MODE`` environment variable, which wins over the ``rank_mode``
ini option (default ``both``). ``--launcher torchrun`` replaces the modes with
``launched`` (this process is one rank of a torchrun job). pytest-timeout
guards the parent: a marked test without its own ``timeout`` mark gets
``timeout_s`` plus :data:`POOL_START_MARGIN_S`.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from harness.settings import SettingError, modes_of, resolve_rank_mode

__all__ = ["POOL_START_MARGIN_S", "selected_modes"]

POOL_START_MARGIN_S = 120.0


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from harness import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-harness")
    group.addoption("--rank-mode", default=None, help="process, thread or both (default: both)")
    group.addoption(
        "--launcher",
        default="spawn",
        choices=("spawn", "torchrun"),
        help="spawn: the harness starts ranks; torchrun: this process is one rank of a launched job",
    )
    parser.addini("rank_mode", "default rank mode for @pytest.mark.ranks tests", default="both")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ranks(world_size=2, modes=('process', 'thread'), timeout_s=60, isolated=False, placement='cpu', "
        "env=None): run the test body on world_size ranks (first parameter: ctx)",
    )
    selected_modes(config)  # validate early, with the source of a bad value


def selected_modes(config: pytest.Config) -> tuple[str, ...]:
    """The rank modes chosen for this session (see the module docstring for precedence)."""
    if config.getoption("--launcher") == "torchrun":
        return ("launched",)
    try:
        chosen = resolve_rank_mode(
            cli=config.getoption("--rank-mode"),
            env=os.environ.get("FSDP_RANK_MODE"),
            ini=config.getini("rank_mode"),
        )
    except SettingError as exc:
        raise pytest.UsageError(str(exc)) from exc
    return modes_of(chosen.value)


class _CtxPlaceholder:
    """Stands in for ``ctx`` until the harness passes each rank its ``RankContext``."""

    def __getattr__(self, name: str) -> Any:
        raise pytest.UsageError(f"ctx.{name}: ctx is only usable in tests marked @pytest.mark.ranks")


@pytest.fixture
def ctx() -> Any:
    """Placeholder: in a ``ranks`` test the harness passes each rank's ``RankContext``."""
    return _CtxPlaceholder()


@pytest.fixture
def rank_mode(request: pytest.FixtureRequest) -> str:
    return str(getattr(request, "param", "process"))


def _marker_kwargs(marker: pytest.Mark) -> dict[str, Any]:
    allowed = {"world_size", "modes", "timeout_s", "isolated", "placement", "env"}
    unknown = set(marker.kwargs) - allowed
    if unknown or marker.args:
        raise pytest.UsageError(f"@pytest.mark.ranks takes keywords {sorted(allowed)}; got {marker}")
    return {
        "world_size": marker.kwargs.get("world_size", 2),
        "modes": tuple(marker.kwargs.get("modes", ("process", "thread"))),
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
    modes = ["launched"] if chosen == ("launched",) else [m for m in declared if m in chosen]
    if "rank_mode" not in metafunc.fixturenames:
        metafunc.fixturenames.append("rank_mode")
    metafunc.parametrize("rank_mode", modes, ids=modes, indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("ranks")
        if marker is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(_marker_kwargs(marker)["timeout_s"] + POOL_START_MARGIN_S))


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
        world_size=options["world_size"],
        mode=str(pyfuncitem.funcargs.get("rank_mode") or pyfuncitem.callspec.params["rank_mode"]),
        placement=pyfuncitem.ihook.pytest_ranks_placement(item=pyfuncitem) or options["placement"],
        timeout_s=options["timeout_s"],
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
    from harness.errors import RankFailure

    if report.failed and call.excinfo is not None and isinstance(call.excinfo.value, RankFailure):
        report.longrepr = str(call.excinfo.value)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    from harness.runner import shutdown_pools

    shutdown_pools()
