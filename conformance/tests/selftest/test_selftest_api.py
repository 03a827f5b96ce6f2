"""The public self-test API, used as an out-of-tree tool would: a patched adapter and its expected FAILs."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.selftest import uncaught
from conformance.selftest.session import CASES_DIR

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

TOOL = '''
from conformance.adapters.reference import ReferenceAdapter
from conformance.selftest import Expect, PatchedAdapter

class NoSync(PatchedAdapter, ReferenceAdapter):
    name = "tool-no-sync"
    breaks = "sync_module_states"
    expect = Expect("same_model_across_ranks", "thread", ("construction/same_model_across_ranks",))
    spec_overrides = {"sync_module_states": False}

class Harmless(PatchedAdapter, ReferenceAdapter):
    """Breaks nothing the expected rows check: the negative control."""
    name = "tool-harmless"
    breaks = "nothing"
    expect = Expect("same_model_across_ranks", "thread", ("construction/same_model_across_ranks",))
    spec_overrides = {"limit_all_gathers": False}
'''


def test_uncaught_names_only_the_patch_no_row_catches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tool.py").write_text(TOOL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the session's interpreter
    monkeypatch.syspath_prepend(str(tmp_path))  # this one (uncaught reads each class's expect)
    problems = uncaught({"tool-no-sync": "my_tool:NoSync", "tool-harmless": "my_tool:Harmless"},
                        report=tmp_path / "r.json", files=[str(CASES_DIR / "test_construction.py")])
    assert problems, "the harmless patch must be reported as uncaught"
    expected = "tool-harmless was not caught by construction/same_model_across_ranks"
    assert all(p.startswith(expected) for p in problems), problems
