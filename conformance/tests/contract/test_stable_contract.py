"""The contract's stable surface (docs/ADAPTER_GUIDE.md, section 8): every module path it, or the fuzz engine
that reproducers import, was published under still imports, and an adapter written against the oldest
protocol, with every capability name since renamed or removed, loads and declares what its author meant."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings
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
    # The fuzz engine's package and every module of it; ``runner`` is the parity fuzzer.
    "conformance.cases.fuzz": "conformance.fuzz",
    "conformance.cases.fuzz.controls": "conformance.fuzz.controls",
    "conformance.cases.fuzz.drawing": "conformance.fuzz.drawing",
    "conformance.cases.fuzz.driver": "conformance.fuzz.driver",
    "conformance.cases.fuzz.example": "conformance.fuzz.example",
    "conformance.cases.fuzz.gathers": "conformance.fuzz.gathers",
    "conformance.cases.fuzz.held": "conformance.fuzz.held",
    "conformance.cases.fuzz.model": "conformance.fuzz.model",
    "conformance.cases.fuzz.neighbours": "conformance.fuzz.neighbours",
    "conformance.cases.fuzz.ops": "conformance.fuzz.ops",
    "conformance.cases.fuzz.options": "conformance.fuzz.option_neighbours",
    "conformance.cases.fuzz.precision": "conformance.fuzz.drawn_precision",
    "conformance.cases.fuzz.prefetching": "conformance.fuzz.prefetching",
    "conformance.cases.fuzz.runner": "conformance.fuzz.parity_run",
    "conformance.cases.fuzz.searching": "conformance.fuzz.searching",
    "conformance.cases.fuzz.shadow": "conformance.fuzz.shadow",
    "conformance.cases.fuzz.stateful": "conformance.fuzz.stateful",
    "conformance.cases.fuzz.unsynced": "conformance.fuzz.unsynced",
    "conformance.cases.fuzz.wrapping": "conformance.fuzz.wrapping",
    # The fuzz engine's modules since renamed for what they hold.
    "conformance.fuzz.compare": "conformance.fuzz.twin_checks",
    "conformance.fuzz.optimizers": "conformance.fuzz.drawn_optimizers",
    "conformance.fuzz.options": "conformance.fuzz.option_neighbours",
    "conformance.fuzz.parity": "conformance.fuzz.parity_run",
    "conformance.fuzz.precision": "conformance.fuzz.drawn_precision",
    "conformance.fuzz.verdicts": "conformance.fuzz.agreement",
}
#: Names the old paths were imported for, in the guide's and the README's examples.
NAMES = {
    "conformance.adapters.base": ("Capability", "FSDPAdapter", "UnitInfo", "WrapSpec", "PROTOCOL_VERSION"),
    "conformance.case": ("case",),
    "conformance.rows": ("row_matches", "case_row_id"),
    "conformance.report": ("CaseReport", "Result", "OUTCOMES"),
    "conformance.findings": ("Finding",),
    # What a reproducer the fuzzers rendered, pasted with conformance/cases/test_fuzz.py's imports, uses.
    "conformance.cases.fuzz.runner": ("run_example", "check_example"),
    "conformance.cases.fuzz.stateful": ("run_program", "check_program"),
    "conformance.cases.fuzz.example": ("Block", "Example", "ModelSpec", "Policy"),
    "conformance.cases.fuzz.ops": ("Config", "Forward", "Program", "Step", "Train"),
    "conformance.cases.fuzz.neighbours": ("NEIGHBOURS_USE",),
    # The same, pasted with test_fuzz.py's imports of the time.
    "conformance.fuzz.parity": ("run_example", "check_example"),
    "conformance.fuzz.precision": ("precision_note",),
}
#: A file a user saved before the fuzz engine moved: a reproducer's imports, as test_fuzz.py had them.
SAVED_REPRODUCER = """
from conformance.cases.fuzz.example import Block, Example, ModelSpec, Policy
from conformance.cases.fuzz.neighbours import NEIGHBOURS_USE
from conformance.cases.fuzz.ops import Config, Forward, Program, Step
from conformance.cases.fuzz.runner import run_example
from conformance.cases.fuzz.stateful import run_program

import conformance.fuzz.example, conformance.fuzz.neighbours, conformance.fuzz.ops, conformance.fuzz.parity_run
import conformance.fuzz.stateful
assert run_example is conformance.fuzz.parity_run.run_example and run_program is conformance.fuzz.stateful.run_program
assert Example is conformance.fuzz.example.Example and Program is conformance.fuzz.ops.Program
print("same objects")
"""

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
        Capability.FULL_STATE_DICT_LOAD_ON_THREADS, Capability.PARAM_INIT_FN, Capability.THREAD_RANKS,
        Capability.EXEC_ORDER_VALIDATION,
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
    "Capability.COMPUTE_DEVICE, Capability.PLACEMENT_MESSAGES, Capability.RESHARD_INTROSPECTION,\n       ").replace(
    "Capability.PARAM_INIT_FN,", "Capability.META_MATERIALIZATION, Capability.PARAM_INIT_FUNCTION,")
_DELEGATES = "".join(f"\n    def {m}(self, *args, **kwargs):\n        return ReferenceAdapter().{m}(*args, **kwargs)\n"
                     for m in _METHODS)


def _forget(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next import of ``module`` run it again (put back after the test)."""
    parent, _, leaf = module.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a moved parent (``conformance.cases.fuzz``) warns too
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


def test_a_moved_package_refuses_a_module_it_never_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """``conformance.cases.fuzz`` is ``conformance.fuzz``, yet ``conformance.cases.fuzz.agreement`` (a module only
    the new package has) is not loaded a second time under the old name."""
    _forget("conformance.cases.fuzz", monkeypatch)
    with pytest.warns(DeprecationWarning, match="^conformance.cases.fuzz moved to conformance.fuzz: import"):
        importlib.import_module("conformance.cases.fuzz")
    with pytest.raises(ModuleNotFoundError, match=r"'conformance.cases.fuzz.agreement' \(conformance.cases.fuzz moved"):
        importlib.import_module("conformance.cases.fuzz.agreement")
    assert "conformance.cases.fuzz.agreement" not in sys.modules


def test_a_reproducer_saved_with_the_old_paths_imports_the_same_objects(tmp_path: Path) -> None:
    """In a fresh interpreter (no module imported yet, no pytest): each old path warns once, naming the saved
    file, and gives the engine's own objects."""
    saved = tmp_path / "saved_reproducer.py"
    saved.write_text(SAVED_REPRODUCER)
    run = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", str(saved)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout == "same objects\n", run.stdout + run.stderr[-3000:]
    warned = re.findall(r"^(.*):(\d+): DeprecationWarning: (\S+) moved to (\S+):", run.stderr, flags=re.MULTILINE)
    moved = sorted((old, new) for _, _, old, new in warned)
    assert moved == sorted({(old, new) for old, new in PUBLISHED.items() if old.startswith("conformance.cases.fuzz")
                            and old.rpartition(".")[2] in ("fuzz", "example", "neighbours", "ops", "runner",
                                                            "stateful")}), run.stderr
    assert {Path(path) for path, _, _, _ in warned} == {saved}, run.stderr


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
    for name in ("DEVICE_ID", "FLAT_PARAM_INTROSPECTION", "PARAM_INIT_FN"):
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
