"""The harness's module paths before it was grouped by its jobs (or renamed) still import, warning with the new
path."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

import harness

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

_RANKS = ("runner", "process", "thread_host", "threads", "launched", "_host_main", "_rank_main", "_rank_state",
          "_torch_threadlocal", "context", "outcome", "errors", "reset", "devices", "cpu_budget", "main_guard",
          "rank_mode", "warnings_capture")
#: Written out here, not read from ``harness.moved``: dropping a path must fail this test.
OLD_PATHS = {
    **{f"harness.{name}": f"harness.ranks.{name}" for name in _RANKS},
    **{f"harness.{name}": f"harness.collectives.{name}" for name in ("observe", "recorder", "sequence",
                                                                     "comm_worker")},
    **{f"harness.{name}": f"harness.plugin.{name}" for name in ("pytest_plugin", "hookspecs", "scheduling",
                                                                "workers")},
    "harness.settings": "harness.setting_sources",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_imports_the_new_module_warning(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new = OLD_PATHS[old]
    __import__(new)
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(harness, old.rpartition(".")[2], raising=False)
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(new)}: import") as seen:
        __import__(old)
    assert sys.modules[old] is sys.modules[new]
    assert [Path(w.filename) for w in seen] == [Path(__file__)], "the warning must name the importing line"


def test_from_harness_import_an_old_module_warns_and_gives_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.collectives.recorder

    monkeypatch.delitem(sys.modules, "harness.recorder", raising=False)
    monkeypatch.delattr(harness, "recorder", raising=False)
    with pytest.warns(DeprecationWarning, match="^harness.recorder moved to harness.collectives.recorder"):
        from harness import recorder
    assert recorder is harness.collectives.recorder


def test_a_name_the_harness_never_had_is_not_found() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModuleNotFoundError):
            __import__("harness.no_such_module")
