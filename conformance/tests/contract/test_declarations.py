"""Case declarations, the adapter registry and the adapter contract."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from importlib.metadata import EntryPoint, distribution
from pathlib import Path
from typing import Any

import pytest
import torch.nn as nn

from conformance.contract import registry
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import ANY_GPU, CaseSpec, NotApplicable, case, gpu_rows
from conformance.runner.listing import CASES_DIR

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]


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

    root = Path(__file__).resolve().parents[3]
    builtin = load_file(BUILTIN_FILE)
    assert all((root / f.doc).is_file() for f in builtin), "a finding points at a missing write-up"
    assert all(f.reason for f in builtin), "a built-in finding without a reason labels every failure of its rows"
    documented = [f for f in builtin if f.kind == "documented"]
    # a citation names the version of what it cites: torch's, or DeepSpeed's for its adapters' findings
    version = {True: "DeepSpeed 0.19.", False: "torch 2.13.0"}
    assert documented and all(f.documentation and version[f.impl.startswith("deepspeed-")] in f.documentation
                              for f in documented)
    sync = next(f for f in documented if f.rows == "construction/same_model_across_ranks")
    reason = ("rank 0 raised ValueError: The module has CPU parameters or buffers when `sync_module_states=True`, "
              "which requires them to be on GPU.")
    assert annotate(sync.impl, sync.rows + "[x=1]", reason).startswith(
        f"known finding, documented limitation ({sync.documentation}), see docs/findings/")
    assert annotate("reference", sync.rows, reason) == reason  # the outcome (FAIL) and other impls untouched


def test_gpus_may_depend_on_parameters() -> None:
    spec = CaseSpec(id="a/b", gpus=gpu_rows)
    assert spec.gpus_for({"on": "gpu"}) is ANY_GPU and spec.gpus_for({"on": "cpu"}) is None
    assert spec.needs_text({"on": "gpu"}) == "any GPU, ws 2" and spec.needs_text({"on": "cpu"}) == "cpu, ws 2"
    with pytest.raises(ValueError, match="needs a grid parameter on='cpu'|'gpu', got on=None"):
        spec.gpus_for({})
    with pytest.raises(ValueError, match=r"case a/c: gpus must be None, ANY_GPU or distinct_gpus\(N\), got 'x'"):
        CaseSpec(id="a/c", gpus=lambda p: "x").gpus_for({})  # type: ignore[arg-type,return-value]


def _case_functions() -> dict[str, list[tuple[Callable[..., Any], CaseSpec]]]:
    """Case file stem -> its case functions, each with the CaseSpec its ``conformance`` mark carries."""
    out: dict[str, list[tuple[Callable[..., Any], CaseSpec]]] = {}
    for path in sorted(CASES_DIR.glob("test_*.py")):
        module = importlib.import_module(f"conformance.cases.{path.stem}")
        out[path.stem] = [(fn, m.args[0]) for fn in vars(module).values() for m in getattr(fn, "pytestmark", ())
                          if m.name == "conformance"]
    return out


def _declared_by_file() -> dict[str, list[CaseSpec]]:
    """Case file stem -> the cases it declares."""
    return {stem: [spec for _, spec in cases] for stem, cases in _case_functions().items()}


def test_every_case_explains_what_it_asserts() -> None:
    """Each case's docstring says what its rows assert (40 characters at least), so a FAIL can be classified
    without reading the body."""
    unexplained = [spec.id for cases in _case_functions().values() for fn, spec in cases
                   if len((fn.__doc__ or "").strip()) < 40]
    assert not unexplained, f"cases without a docstring saying what they assert: {sorted(unexplained)}"


def test_each_case_file_is_one_area_listed_in_the_guide() -> None:
    """test_<area>.py declares only <area>/... cases; docs/ADDING_A_CASE.md's table names exactly these areas."""
    by_file = _declared_by_file()
    strays = [(stem, spec.id) for stem, specs in by_file.items() for spec in specs
              if spec.area != stem.removeprefix("test_")]
    assert not strays, f"cases outside their file's area: {strays}"
    guide = (Path(__file__).resolve().parents[3] / "docs" / "ADDING_A_CASE.md").read_text()
    section = guide.split("## 1. Pick the area file", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M))
    assert listed == {stem.removeprefix("test_") for stem in by_file}, listed


def test_no_case_is_a_placement_twin() -> None:
    """A behaviour checked on CPU and GPU is one case whose gpus depend on its grid, not two ids."""
    ids = {spec.id for specs in _declared_by_file().values() for spec in specs}
    twins = sorted(i for i in ids if i.endswith("_gpu") or (i.endswith("_cpu") and i.removesuffix("_cpu") in ids))
    assert not twins, twins
