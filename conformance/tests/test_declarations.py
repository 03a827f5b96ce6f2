"""Case declarations, the adapter registry and the adapter contract."""

from __future__ import annotations

from importlib.metadata import EntryPoint, distribution

import pytest
import torch.nn as nn

from conformance.contract import registry
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import CaseSpec, NotApplicable, case


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"id": "no_slash"}, "must look like 'area/name'"),
        ({"id": "a/b", "world_size": 0}, "world_size must be >= 1, got 0"),
        ({"id": "a/b", "modes": ("fork",)}, "modes must be a non-empty subset"),
        ({"id": "a/b", "timeout_s": 0}, "timeout_s must be > 0"),
        ({"id": "a/b", "gpus": 2}, "gpus must be None, ANY_GPU or distinct_gpus\\(N\\), got 2"),
    ],
)
def test_case_spec_rejects_bad_declarations(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        CaseSpec(**kwargs)


def test_case_adds_ranks_and_conformance_marks() -> None:
    @case("area/name", world_size=4, modes=("process",), timeout_s=30)
    def test_x(ctx: object, impl: object) -> None: ...

    marks = {m.name: m for m in test_x.pytestmark}  # type: ignore[attr-defined]
    assert marks["ranks"].kwargs["world_size"] == 4
    assert marks["ranks"].kwargs["modes"] == ("process",)
    spec = marks["conformance"].args[0]
    assert spec.id == "area/name" and spec.area == "area"


def test_requires_may_depend_on_parameters() -> None:
    spec = CaseSpec(
        id="a/b",
        requires=lambda p: [] if p["use_orig_params"] else [Capability.FLAT_PARAM],
    )
    assert spec.required({"use_orig_params": True}) == []
    assert spec.required({"use_orig_params": False}) == [Capability.FLAT_PARAM]


def test_thread_ranks_are_a_capability_every_case_needs_in_thread_mode() -> None:
    spec = CaseSpec(id="a/b", requires=[Capability.FLAT_PARAM])
    assert spec.required({"rank_mode": "process"}) == [Capability.FLAT_PARAM]
    assert spec.required({"rank_mode": "thread"}) == [Capability.FLAT_PARAM, Capability.THREAD_RANKS]


def test_not_applicable_is_a_skip_but_distinguishable() -> None:
    assert issubclass(NotApplicable, pytest.skip.Exception)


def test_wrap_spec_validates_strategy_and_prefetch() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'FULL'"):
        WrapSpec(strategy="FULL")
    with pytest.raises(ValueError, match="backward_prefetch must be"):
        WrapSpec(backward_prefetch="PRE")
    with pytest.raises(ValueError, match="needs at least one module class"):
        AutoWrap()
    assert WrapSpec(strategy="HYBRID_SHARD").is_hybrid
    assert AutoWrap(kind="always").module_classes == ()
    assert AutoWrap((nn.Linear,)).kind == "module_classes"


def _own_entry_points(group: str) -> list[EntryPoint]:
    """This project's entry points only: other installed adapters (a third party's) are not the subject here."""
    return [ep for ep in distribution("fsdp-conformance").entry_points if ep.group == group]


@pytest.fixture
def builtins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry sees the built-in adapters alone, whatever else the environment installs or names."""
    monkeypatch.setattr(registry, "entry_points", lambda group: _own_entry_points(group))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)


@pytest.mark.usefixtures("builtins_only")
def test_registry_lists_builtins_and_rejects_unknown_names() -> None:
    names = registry.registered()
    assert {"reference", "torch-fsdp1", "torch-fsdp2"} <= set(names)
    with pytest.raises(registry.UnknownAdapter, match="no FSDP adapter named 'nope'; registered: .*reference"):
        registry.load("nope")
    assert registry.expand(["torch-fsdp2", "all"])[0] == "torch-fsdp2"
    usable = [n for n in names if registry.load(n).unavailable_reason() is None]
    # ``all`` is every registered adapter usable here, each once, in registration order
    # (an optional extra that is not installed, e.g. fairscale-fsdp, is left out).
    assert registry.expand(["all", "all"]) == usable
    assert {"reference", "torch-fsdp1", "torch-fsdp2"} <= set(usable)


def test_builtin_entry_points_are_registered_in_metadata() -> None:
    eps = {ep.name: ep.value for ep in _own_entry_points(registry.ENTRY_POINT_GROUP)}
    assert eps == registry.BUILTIN


@pytest.mark.parametrize("name", ["torch-fsdp1", "torch-fsdp2"])
def test_torch_adapters_implement_the_protocol(name: str) -> None:
    adapter = registry.load(name)
    assert isinstance(adapter, FSDPAdapter)
    assert adapter.unavailable_reason() is None
    assert all(isinstance(c, Capability) for c in adapter.capabilities)


def test_fsdp2_has_no_exec_order_validation() -> None:
    assert Capability.EXEC_ORDER_VALIDATION not in registry.load("torch-fsdp2").capabilities
    assert Capability.EXEC_ORDER_VALIDATION in registry.load("torch-fsdp1").capabilities


def test_known_findings_annotate_but_never_change_outcomes() -> None:
    from pathlib import Path

    from conformance.runner.findings import BUILTIN_FILE, annotate, load_file

    root = Path(__file__).resolve().parents[2]
    builtin = load_file(BUILTIN_FILE)
    assert all((root / f.doc).is_file() for f in builtin), "a finding points at a missing write-up"
    first = builtin[0]
    assert annotate(first.impl, first.rows + "[x=1]", "boom").startswith("known finding, see docs/findings/")
    assert annotate("reference", first.rows, "boom") == "boom"
