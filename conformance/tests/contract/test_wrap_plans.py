"""Nesting is a plan the adapter realises: :class:`AutoWrap` by classes or by submodule names, validated; a
case that nests ``wrap`` calls itself must declare :attr:`Capability.MANUAL_NESTING`; and an FSDP whose units
come from one root call with a class list (:mod:`conformance.tests.adapters.class_list_adapter`) gets the
reference's outcome on every row it runs, rows that nest by hand ``n/a``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.nn as nn

from conformance.contract.adapter import PROTOCOL_VERSION, AutoWrap, Capability, WrapSpec
from conformance.contract.declared import DeclaredAdapter, UndeclaredCapability
from conformance.runner import cli
from conformance.tests.adapters.class_list_adapter import ClassListAdapter
from fixtures.models import ThreeLinear
from harness.tests.inprocess import run_main

ADAPTERS = "class-list=conformance.tests.adapters.class_list_adapter:ClassListAdapter"
#: Rows whose units are a plan by name (one of them nests by hand too, and must be n/a for class-list); thread
#: ranks keep it cheap.
SELECTION = "load_in_loop or uneven_shared or invalid_first_iter_order or structured_outputs or homogeneous_attributes"


def test_a_plan_by_name_selects_those_submodules_in_module_order() -> None:
    model = ThreeLinear(seed=0)
    plan = AutoWrap(kind="module_names", module_names=("lin3", "lin1"))
    assert plan.units_under(model) == [model.lin1, model.lin3]
    assert plan.units_under(model, ignored=[model.lin1]) == [model.lin3]
    assert AutoWrap.submodules(model, [model.lin2]) == AutoWrap(kind="module_names", module_names=("lin2",))
    assert AutoWrap((nn.Linear,)).units_under(model) == [model.lin1, model.lin2, model.lin3]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kind": "names"}, "AutoWrap.kind must be one of .*got 'names'"),
    ({"kind": "module_names"}, "needs non-empty dotted submodule names, got \\(\\)"),
    ({"kind": "module_names", "module_names": ("lin1", ".lin2")}, "got \\('lin1', '.lin2'\\)"),
    ({"kind": "module_names", "module_names": ("lin1", "lin1")}, "lists \\['lin1'\\] more than once"),
    ({"kind": "module_names", "module_names": ("lin1",), "module_classes": (nn.Linear,)}, "takes no module classes"),
    ({"module_classes": (nn.Linear,), "module_names": ("lin1",)}, "kind='module_classes'\\) takes no module names"),
])
def test_a_bad_plan_is_refused_naming_the_bad_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoWrap(**kwargs)  # type: ignore[arg-type]


def test_a_name_the_module_lacks_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="module_names \\['lin4'\\] name no submodule of the ThreeLinear"):
        AutoWrap(kind="module_names", module_names=("lin1", "lin4")).units_under(ThreeLinear(seed=0))
    with pytest.raises(ValueError, match="\\['Linear'\\] are not submodules of the ThreeLinear"):
        AutoWrap.submodules(ThreeLinear(seed=0), [nn.Linear(2, 2)])


class _Recording:
    """An adapter that wraps nothing: it returns the module (as ``fully_shard`` does) and records the call."""

    name = "recording"
    capabilities = frozenset({Capability.MANUAL_NESTING})
    protocol_version = PROTOCOL_VERSION

    def __init__(self) -> None:
        self.wrapped: list[nn.Module] = []

    def supports_strategy(self, strategy: str | None) -> bool:
        return True

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        self.wrapped.append(module)
        return module


def test_nesting_wraps_by_hand_is_an_error_in_a_case_that_does_not_declare_it() -> None:
    model = ThreeLinear(seed=0)
    guarded = DeclaredAdapter(_Recording(), [], "demo/nests")
    guarded.wrap(model.lin2, WrapSpec())
    guarded.wrap(model.lin3, WrapSpec())  # another root beside it: no nesting
    with pytest.raises(UndeclaredCapability, match="case demo/nests wraps a ThreeLinear holding modules it wrapped "
                                                   "before \\('lin2', 'lin3'\\): manual nesting"):
        guarded.wrap(model, WrapSpec())
    assert guarded.unwrapped.wrapped == [model.lin2, model.lin3], "the nested wrap must not reach the adapter"
    declared = DeclaredAdapter(_Recording(), [Capability.MANUAL_NESTING], "demo/declares")
    declared.wrap(model.lin2, WrapSpec())
    declared.wrap(model, WrapSpec())
    assert declared.unwrapped.wrapped == [model.lin2, model]


def test_a_plan_is_no_nesting() -> None:
    model = ThreeLinear(seed=0)
    guarded = DeclaredAdapter(_Recording(), [], "demo/plans")
    guarded.wrap(model, WrapSpec(auto_wrap=AutoWrap(kind="module_names", module_names=("lin2",))))
    assert guarded.unwrapped.wrapped == [model]


class _Protocol2(_Recording):
    """The recording adapter as written before plans by name (protocol 2)."""

    protocol_version = 2

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        assert spec.auto_wrap is None, "a protocol-2 adapter must never see a plan by name"
        return super().wrap(module, spec)


def test_an_older_adapter_gets_a_plan_by_name_as_nested_calls_deepest_first() -> None:
    model = nn.Sequential(ThreeLinear(seed=0), nn.Linear(2, 2))
    ignored = model[0].lin1
    guarded = DeclaredAdapter(_Protocol2(), [Capability.IGNORED_MODULES], "demo/old")
    plan = AutoWrap(kind="module_names", module_names=("0", "0.lin2", "1"))
    guarded.wrap(model, WrapSpec(auto_wrap=plan, ignored_modules=[ignored]))
    assert guarded.unwrapped.wrapped == [model[0].lin2, model[0], model[1], model]


def test_the_class_list_adapter_realises_a_plan_by_name_with_one_call() -> None:
    """Its units are the plan's, from one wrap; it refuses to wrap a model that holds a unit."""
    adapter = ClassListAdapter()
    model = ThreeLinear(seed=0)
    classes = adapter._classes(model, WrapSpec(auto_wrap=AutoWrap(kind="module_names", module_names=("lin2",))))
    assert len(classes) == 1 and isinstance(model.lin2, classes[0]) and not isinstance(model.lin1, classes[0])


def test_class_list_gets_the_references_outcomes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", ADAPTERS)
    out = tmp_path / "r.json"
    run = run_main(cli.main, "run", "--impl", "reference", "--impl", "class-list", "--rank-mode", "thread",
                   "-k", SELECTION, "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    by_impl: dict[str, dict[str, tuple[str, str]]] = {}
    for row in rows:
        by_impl.setdefault(row["impl"], {})[row["case"]] = (row["outcome"], row["reason"])
    reference, class_list = by_impl["reference"], by_impl["class-list"]
    assert set(reference) == set(class_list), run.stdout[-3000:]
    nested = {case for case in reference if case.startswith("construction/homogeneous_attributes")}
    assert nested and all(reference[case][0] == "pass" for case in nested), reference
    assert {case: class_list[case] for case in nested} == dict.fromkeys(
        nested, ("n/a", "class-list lacks capability manual_nesting"))
    planned = set(reference) - nested
    differ = {case: (reference[case], class_list[case]) for case in planned
              if class_list[case][0] != reference[case][0]}
    assert not differ, f"class-list vs the reference: {differ}"
    assert {reference[case][0] for case in planned} == {"pass"}, reference
