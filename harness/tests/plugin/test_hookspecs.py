"""The harness's declared hook and its settings resolver."""

from __future__ import annotations

import pytest

from harness.ranks.rank_mode import RankMode, excluded_reason, modes_of, resolve_selection
from harness.setting_sources import Resolved, SettingError, choice, resolve, whole_number, word_or_whole_number

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

PLUGIN = '''
import json, pathlib

def pytest_ranks_returned(item, values):
    path = pathlib.Path(item.config.rootpath, "returned.json")
    seen = json.loads(path.read_text()) if path.exists() else {}
    seen[item.name] = values
    path.write_text(json.dumps(seen))
'''

BODIES = '''
import pytest

@pytest.mark.ranks(world_size=2, modes=("thread",))
def test_returns_rank(ctx):
    return ctx.rank * 10

@pytest.mark.ranks(world_size=2, modes=("thread",))
def test_returns_nothing(ctx):
    pass
'''


def test_ranks_returned_hands_every_rank_value_to_plugins(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PLUGIN)
    pytester.makepyfile(test_bodies=BODIES)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", "conformance.pytest_plugin")
    result.assert_outcomes(passed=2)
    import json

    seen = json.loads((pytester.path / "returned.json").read_text())
    assert seen == {"test_returns_rank[thread]": [0, 10], "test_returns_nothing[thread]": [None, None]}


def test_resolve_takes_the_first_given_source_and_names_it() -> None:
    got = resolve("n", [("--n", None), ("N_ENV", ""), ("ini n", "4")], int, 1)
    assert got == Resolved("n", 4, "ini n")
    assert resolve("n", [("--n", None)], int, 1) == Resolved("n", 1, "default")
    with pytest.raises(SettingError, match=r"^N_ENV='x': invalid literal"):
        resolve("n", [("--n", None), ("N_ENV", "x")], int, 1)


def test_rank_mode_precedence_and_errors() -> None:
    assert resolve_selection(cli="process", env="thread", ini="both").source == "--fsdp-rank-mode"
    assert resolve_selection(cli=None, env="thread", ini="both") == Resolved("rank mode", "thread", "FSDP_RANK_MODE")
    assert resolve_selection(cli=None, env=None, ini=None).value == "both"
    with pytest.raises(SettingError,
                       match=r"^FSDP_RANK_MODE='threads': expected one of both, process, thread, launched$"):
        resolve_selection(cli=None, env="threads")
    assert modes_of("both") == (RankMode.PROCESS, RankMode.THREAD) and modes_of("launched") == (RankMode.LAUNCHED,)
    with pytest.raises(ValueError, match="rank mode selection 'all' is not one of both, process, thread, launched"):
        modes_of("all")


def test_a_mode_a_case_does_not_declare_is_excluded_with_the_reason() -> None:
    assert excluded_reason(RankMode.THREAD, (RankMode.PROCESS, RankMode.THREAD)) is None
    assert excluded_reason(RankMode.LAUNCHED, (RankMode.PROCESS,)) is None  # a launched job runs every case
    assert excluded_reason(RankMode.THREAD, (RankMode.PROCESS,)) == \
        "declared for process ranks only, which excludes thread ranks"


def test_the_parsers_every_setting_uses() -> None:
    assert choice(("a", "b"))(" b ") == "b"
    with pytest.raises(ValueError, match="^expected one of a, b$"):
        choice(("a", "b"))("c")
    assert whole_number(1)("3") == 3
    for bad in ("0", "x", "1.5"):
        with pytest.raises(ValueError, match="^expected a whole number >= 1$"):
            whole_number(1)(bad)
    assert word_or_whole_number(("auto",), 0)("auto") == "auto" and word_or_whole_number(("auto",), 0)(0) == 0
    with pytest.raises(ValueError, match="^expected auto or a whole number >= 0$"):
        word_or_whole_number(("auto",), 0)("-1")
