"""The contract's stable surface (docs/ADAPTER_GUIDE.md, section 8): every module path it was published
under still imports, and an adapter written against the oldest protocol, with every capability name since
renamed or removed, loads and declares what its author meant."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conformance.contract import optional, registry
from conformance.contract.adapter import DEPRECATED_CAPABILITIES, Capability
from conformance.runner import cli
from conformance.runner.listing import collect_rows
from harness.tests.inprocess import run_main

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

#: Every module path the guide or the README named before the contract moved -> where it went.
#: Written out here, not read from ``conformance.contract.moved``: dropping a path must fail this test.
PUBLISHED = {
    "conformance.adapters.base": "conformance.contract.adapter",
    "conformance.adapters.optional": "conformance.contract.optional",
    "conformance.applicability": "conformance.contract.applicability",
    "conformance.case": "conformance.contract.case",
    "conformance.registry": "conformance.contract.registry",
    "conformance.rows": "conformance.contract.rows",
    "conformance.report": "conformance.contract.results",
    "conformance.findings": "conformance.runner.findings",
    "conformance.settings": "conformance.runner.settings",
}
#: Names the old paths were imported for, in the guide's and the README's examples.
NAMES = {
    "conformance.adapters.base": ("Capability", "FSDPAdapter", "UnitInfo", "WrapSpec", "PROTOCOL_VERSION"),
    "conformance.case": ("case",),
    "conformance.rows": ("row_matches", "case_row_id"),
    "conformance.report": ("CaseReport", "Result", "OUTCOMES"),
    "conformance.findings": ("Finding",),
}

_METHODS = ("wrap", "units", "full_params", "full_state_dict", "sharded_state_dict", "load_state_dict",
            "optim_state_dict", "load_optim_state_dict")
#: An adapter as its author wrote it against protocol 1 (no protocol_version, no optional method), from the
#: guide of the time: the old import path, and every capability name since renamed or removed.
OLD_ADAPTER = '''
from conformance.adapters.base import Capability, UnitInfo, WrapSpec
from conformance.adapters.reference import ReferenceAdapter


class OldAdapter:
    name = "old-names"
    capabilities = frozenset({
        Capability.DEVICE_ID, Capability.FLAT_PARAM_INTROSPECTION, Capability.OPTIM_STATE_DICT_ON_THREADS,
        Capability.FULL_STATE_DICT_LOAD_ON_THREADS, Capability.THREAD_RANKS, Capability.EXEC_ORDER_VALIDATION,
        Capability.FULL_STATE_DICT, Capability.SHARDED_STATE_DICT, Capability.OPTIM_STATE_DICT,
    })

    def unavailable_reason(self):
        return None

    def supports_strategy(self, strategy):
        return strategy != "NO_SHARD"
'''
#: The same adapter as the guide teaches it now.
NEW_ADAPTER = OLD_ADAPTER.replace("conformance.adapters.base", "conformance.contract.adapter").replace(
    '"old-names"', '"new-names"').replace("class OldAdapter", "class NewAdapter").replace(
    "Capability.DEVICE_ID, Capability.FLAT_PARAM_INTROSPECTION, Capability.OPTIM_STATE_DICT_ON_THREADS,\n"
    "        Capability.FULL_STATE_DICT_LOAD_ON_THREADS,",
    "Capability.COMPUTE_DEVICE, Capability.PLACEMENT_MESSAGES, Capability.RESHARD_INTROSPECTION,\n       ")
_DELEGATES = "".join(f"\n    def {m}(self, *args, **kwargs):\n        return ReferenceAdapter().{m}(*args, **kwargs)\n"
                     for m in _METHODS)


def _forget(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next import of ``module`` run it again (put back after the test)."""
    parent, _, leaf = module.rpartition(".")
    __import__(parent)
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delattr(sys.modules[parent], leaf, raising=False)


@pytest.mark.parametrize("old", sorted(PUBLISHED))
def test_a_published_path_imports_warning_with_its_new_one(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    new = PUBLISHED[old]
    __import__(new)
    _forget(old, monkeypatch)
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(new)}: import") as seen:
        __import__(old)
    assert sys.modules[old] is sys.modules[new]
    assert [Path(w.filename) for w in seen] == [Path(__file__)], "the warning must name the importing line"
    for name in NAMES.get(old, ()):
        assert getattr(sys.modules[old], name) is getattr(sys.modules[new], name)


@pytest.fixture
def adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    """The old adapter and its twin, registered as ``old-names`` and ``new-names`` (the old path re-imported)."""
    for module, source in (("old_names_adapter", OLD_ADAPTER), ("new_names_adapter", NEW_ADAPTER)):
        (tmp_path / f"{module}.py").write_text(source + _DELEGATES)
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setenv(registry.ENV_VAR, "old-names=old_names_adapter:OldAdapter,"
                                         "new-names=new_names_adapter:NewAdapter")
    _forget("conformance.adapters.base", monkeypatch)
    with pytest.warns(DeprecationWarning, match="conformance.adapters.base moved to conformance.contract.adapter"):
        old = registry.load("old-names")
    return old, registry.load("new-names")


def test_an_old_adapter_loads_with_a_warning_per_old_name_and_the_same_capabilities(
        adapters: tuple[object, object]) -> None:
    old, new = adapters
    assert {c.name for c in DEPRECATED_CAPABILITIES} <= {c.name for c in old.capabilities}, \
        "the old adapter must declare every deprecated name"
    assert optional.protocol_version(old) == 1
    with pytest.warns(DeprecationWarning) as seen:
        effective = optional.capabilities_of(old)
    messages = sorted(str(w.message) for w in seen)
    assert len(messages) == len(DEPRECATED_CAPABILITIES), messages
    for name in ("DEVICE_ID", "FLAT_PARAM_INTROSPECTION"):
        assert any(f"deprecated Capability.{name}; declare Capability." in m for m in messages), messages
    for name in ("OPTIM_STATE_DICT_ON_THREADS", "FULL_STATE_DICT_LOAD_ON_THREADS"):
        assert any(f"deprecated Capability.{name}; it is ignored: " in m for m in messages), messages
    assert effective == optional.capabilities_of(new)
    assert Capability.OPTIM_STATE_DICT in effective and not effective & set(DEPRECATED_CAPABILITIES)
    with pytest.warns(DeprecationWarning):
        assert optional.thread_rank_limits(old) == optional.thread_rank_limits(new) == {}


def _not_applicable(impl: str) -> dict[str, dict[str, str]]:
    """Every row's n/a reasons for ``impl``, its name replaced by ``X``."""
    return {row.row_id: {mode: reason.replace(impl, "X") for mode, reason in row.not_applicable.items()}
            for row in collect_rows(None, impl)}


def test_an_old_adapter_gets_the_rows_and_outcomes_of_its_twin(adapters: tuple[object, object],
                                                                tmp_path: Path) -> None:
    old, new = _not_applicable("old-names"), _not_applicable("new-names")
    assert old == new
    assert any(not reasons for reasons in new.values()) and any(reasons for reasons in new.values())
    out = tmp_path / "r.json"
    selection = "invalid_later_iter_order and FULL_SHARD-1 or test_roundtrip"
    run = run_main(cli.main, "run", "--impl", "old-names", "--impl", "new-names", "--rank-mode", "thread",
                   "-k", selection, "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by_impl = {impl: {(r["case"], r["rank_mode"]): (r["outcome"], r["reason"].replace(impl, "X"))
                      for r in rows if r["impl"] == impl} for impl in ("old-names", "new-names")}
    assert by_impl["old-names"] == by_impl["new-names"]
    assert {"pass"} == {outcome for outcome, _ in by_impl["old-names"].values()}, by_impl["old-names"]
