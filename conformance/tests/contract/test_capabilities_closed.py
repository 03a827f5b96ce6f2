"""Capabilities fail closed: declared by allow-list, checked once, and never claimed for nothing."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import registry
from conformance.contract.adapter import Capability, MixedPrecisionSpec, WrapSpec
from conformance.contract.applicability import missing_reason
from conformance.contract.declared import DeclaredAdapter, UndeclaredCapability
from conformance.contract.optional import capabilities_of, thread_rank_limits
from conformance.runner.listing import collect_rows
from harness.ranks.rank_mode import RankMode
from harness.tests.inprocess import pytester_run

pytest_plugins = ["pytester", "harness.tests.inprocess"]


class _Recording:
    """An adapter stand-in that records the specs it was asked to wrap."""

    name = "recording"
    capabilities = frozenset({Capability.CPU_OFFLOAD})

    def __init__(self) -> None:
        self.specs: list[WrapSpec] = []

    def supports_strategy(self, strategy: str | None) -> bool:
        return True

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        self.specs.append(spec)
        return module


def test_wrap_spec_names_what_it_needs() -> None:
    assert WrapSpec().required() == []
    assert WrapSpec(forward_prefetch=True).required() == [], "forward_prefetch=True alone is a hint"
    spec = WrapSpec(cpu_offload=True, sync_module_states=True, process_group=(None, None), backward_prefetch=None,
                    mixed_precision=MixedPrecisionSpec(buffer_dtype=None, keep_low_precision_grads=True))
    assert set(spec.required()) == {Capability.CPU_OFFLOAD, Capability.SYNC_MODULE_STATES,
                                    Capability.HYBRID_VIA_PG_TUPLE, Capability.BACKWARD_PREFETCH,
                                    Capability.MIXED_PRECISION, Capability.MP_KEEP_LOW_PRECISION_GRADS,
                                    Capability.MP_CAST_FORWARD_INPUTS}


def test_mixed_precision_asks_for_the_input_cast_only_when_the_case_relies_on_it() -> None:
    """``cast_forward_inputs`` (the default, torch's) needs MP_CAST_FORWARD_INPUTS; a case feeding its
    inputs in the param dtype says ``False`` and needs MIXED_PRECISION alone."""
    bf16 = torch.bfloat16
    assert MixedPrecisionSpec(param_dtype=bf16).required() == [Capability.MIXED_PRECISION,
                                                               Capability.MP_CAST_FORWARD_INPUTS]
    assert MixedPrecisionSpec(param_dtype=bf16, cast_forward_inputs=False).required() == [Capability.MIXED_PRECISION]


def test_a_wrap_needing_more_than_the_row_declared_never_reaches_the_adapter() -> None:
    inner = _Recording()
    guarded = DeclaredAdapter(inner, [], "demo/forgets")
    with pytest.raises(UndeclaredCapability, match=r"case demo/forgets wraps with a spec needing "
                                                   r"Capability\.CPU_OFFLOAD, which its requires does not declare"):
        guarded.wrap(nn.Linear(2, 2), WrapSpec(cpu_offload=True))
    assert inner.specs == []
    declared = DeclaredAdapter(inner, [Capability.CPU_OFFLOAD], "demo/declares")
    declared.wrap(nn.Linear(2, 2), WrapSpec(cpu_offload=True))
    assert len(inner.specs) == 1


def test_the_guarded_adapter_is_the_adapter_otherwise_and_pickles() -> None:
    adapter = registry.load("reference")
    guarded = pickle.loads(pickle.dumps(DeclaredAdapter(adapter, [Capability.CPU_OFFLOAD], "demo/x")))
    assert guarded.name == "reference" and guarded.capabilities == adapter.capabilities
    assert type(guarded.unwrapped) is type(adapter)
    assert capabilities_of(guarded) == capabilities_of(adapter)


def test_a_capability_new_to_the_enum_is_missing_for_every_adapter() -> None:
    """Add a member to Capability (in a fresh interpreter) and load every built-in adapter against it."""
    script = textwrap.dedent('''
        import importlib.util, json, sys, types
        name = "conformance.contract.capabilities"
        spec = importlib.util.find_spec(name)
        source = spec.loader.get_source(name)
        anchor = '    THREAD_RANKS = "thread_ranks"\\n'
        assert anchor in source
        module = types.ModuleType(name)
        module.__file__ = spec.origin
        sys.modules[name] = module
        exec(compile(source.replace(anchor, anchor + '    BRAND_NEW = "brand_new"\\n'), spec.origin, "exec"),
             module.__dict__)
        from conformance.contract import registry
        from conformance.contract.applicability import missing_reason
        from harness.ranks.rank_mode import RankMode
        new = module.Capability.BRAND_NEW
        print(json.dumps({n: missing_reason(registry.load(n), [new], RankMode.PROCESS) for n in registry.BUILTIN}))
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reasons = json.loads(done.stdout.splitlines()[-1])
    assert set(reasons) == set(registry.BUILTIN)
    for adapter, reason in reasons.items():
        assert reason == f"{adapter} lacks capability brand_new", (adapter, reason)


@pytest.mark.parametrize("name", sorted(registry.BUILTIN))
def test_every_declared_capability_is_exercised_for_its_adapter(name: str) -> None:
    """A capability an adapter declares is required (or used where declared) by some row that runs against
    it in some rank mode."""
    adapter = registry.load(name)
    rows = collect_rows(impl=name)
    exercised: set[Capability] = set()
    for row in rows:
        if set(row.modes) - set(row.not_applicable):
            exercised |= row.requires | row.uses
    unexercised = sorted(str(c) for c in capabilities_of(adapter) - exercised)
    assert not unexercised, f"{name} declares capabilities no row runs against it: {unexercised}"


def test_thread_rank_limits_make_thread_rows_not_applicable_with_the_reason() -> None:
    fsdp1 = registry.load("torch-fsdp1")
    needs = [Capability.OPTIM_STATE_DICT]
    assert missing_reason(fsdp1, needs, RankMode.PROCESS) is None
    reason = missing_reason(fsdp1, needs, RankMode.THREAD)
    assert reason is not None and reason.startswith("torch-fsdp1 has optim_state_dict on process ranks only: ")
    assert "SimpleProfiler" in reason
    assert missing_reason(registry.load("reference"), needs, RankMode.THREAD) is None


def test_thread_rank_limits_must_name_declared_capabilities() -> None:
    class Odd(_Recording):
        thread_rank_limits: Any = {Capability.NO_SYNC: "never declared"}

    with pytest.raises(TypeError, match=r"'recording': thread_rank_limits keys must be capabilities it declares"):
        thread_rank_limits(Odd())


FORGETFUL = '''
import torch.nn as nn
from conformance.contract.adapter import WrapSpec
from conformance.contract.case import case

@case("demo/forgets_requires", world_size=2, modes=("thread",))
def test_forgets_requires(ctx, impl):
    impl.wrap(nn.Linear(2, 2), WrapSpec(sync_module_states=True))
'''


def test_a_case_that_forgets_requires_fails_for_every_adapter(preloaded: None, pytester: pytest.Pytester) -> None:
    """Not n/a for those without the capability and pass for the rest: an error in the case, named."""
    pytester.makepyfile(test_forgetful=FORGETFUL)
    out = pytester.path / "r.json"
    result = pytester_run(pytester, "--fsdp-impl", "reference", "--fsdp-impl", "torch-fsdp2",
                          "--conformance-json", str(out), "-p", "no:cacheprovider")
    assert result.ret == 1
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"reference", "torch-fsdp2"}
    for row in rows:
        assert row["outcome"] == "FAIL", row
        assert "UndeclaredCapability: case demo/forgets_requires wraps with a spec needing " \
               "Capability.SYNC_MODULE_STATES" in row["reason"], row
