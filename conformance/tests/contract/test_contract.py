"""The adapter contract: protocol versions, deprecated capabilities, optional methods, findings."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from conformance.adapters.reference import ReferenceAdapter
from conformance.contract import optional, registry
from conformance.contract.adapter import DEPRECATED_CAPABILITIES, PROTOCOL_VERSION, Capability
from conformance.runner.findings import ENV_VAR, annotate
from conformance.runner.listing import collect_rows
from conformance.tests.installed import fake_distribution

pytest_plugins = ["pytester"]


class ProtocolOneAdapter:
    """An adapter as written against protocol 1: no version, no optional methods, the old capability names."""

    name = "protocol-one"
    capabilities = frozenset({Capability.DEVICE_ID, Capability.FLAT_PARAM_INTROSPECTION, Capability.THREAD_RANKS,
                              Capability.EXEC_ORDER_VALIDATION})

    def __init__(self) -> None:
        self._ref = ReferenceAdapter()

    def unavailable_reason(self) -> str | None:
        return None

    def supports_strategy(self, strategy: str | None) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        if name in ("wrap", "units", "full_params", "full_state_dict", "sharded_state_dict", "load_state_dict",
                    "optim_state_dict", "load_optim_state_dict"):
            return getattr(self._ref, name)
        raise AttributeError(name)


def test_a_protocol_one_adapter_loads_with_defaults_and_warned_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.ENV_VAR, f"protocol-one={__name__}:ProtocolOneAdapter")
    adapter = registry.load("protocol-one")
    assert optional.protocol_version(adapter) == 1
    with pytest.warns(DeprecationWarning) as seen:
        caps = optional.capabilities_of(adapter)
    messages = sorted(str(w.message).split("declares ", 1)[-1] for w in seen)
    assert messages == ["deprecated Capability.DEVICE_ID; declare Capability.COMPUTE_DEVICE, "
                        "Capability.PLACEMENT_MESSAGES instead",
                        "deprecated Capability.FLAT_PARAM_INTROSPECTION; declare Capability.RESHARD_INTROSPECTION "
                        "instead"], messages
    assert {Capability.COMPUTE_DEVICE, Capability.PLACEMENT_MESSAGES, Capability.RESHARD_INTROSPECTION} <= caps
    assert not caps & set(DEPRECATED_CAPABILITIES)
    module = nn.Linear(2, 2)
    assert optional.wrapped_module(adapter, module) is module
    assert type(optional.activation_checkpoint_wrapper(adapter, module, offload=False)).__name__ == "CheckpointWrapper"
    with pytest.raises(optional.PostOptimEventUnsupported, match="protocol-one has no post-optimizer event"):
        optional.set_post_optim_event(adapter, module, torch.Event())
    with pytest.raises(optional.NoSyncUnsupported, match="protocol-one has no no_sync"):
        optional.no_sync(adapter, module)
    optional.release(adapter, module)  # the default does nothing: the module stays usable
    assert optional.units_per_module(adapter, "FULL_SHARD")
    assert not optional.step_zeroes_grads(adapter)
    assert module(torch.ones(1, 2)).shape == (1, 2)


@pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]
def test_a_protocol_one_adapter_runs_cases(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old adapter runs real cases whose helpers now go through optional methods (wrapped_module)."""
    monkeypatch.setenv(registry.ENV_VAR, f"protocol-one={__name__}:ProtocolOneAdapter")
    out = pytester.path / "r.json"
    cases = Path(__file__).resolve().parents[2] / "cases" / "test_exec_order.py"
    pytester.runpytest_subprocess(str(cases), "-p", "conformance.pytest_plugin", "--fsdp-impl", "protocol-one",
                                  "--fsdp-rank-mode", "thread",
                                  "-k", "invalid_later_iter_order and FULL_SHARD-1", "-p", "no:cacheprovider",
                                  "--conformance-json", str(out), "-W", "error::DeprecationWarning:conformance.*")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["outcome"]) for r in rows] == [
        ("exec_order/invalid_later_iter_order[strategy=FULL_SHARD,iters_before_path_change=1]", "pass")]


def test_a_newer_protocol_is_refused_naming_both_versions() -> None:
    class Future(ReferenceAdapter):
        protocol_version = PROTOCOL_VERSION + 1

    with pytest.raises(ValueError, match=rf"needs adapter protocol {PROTOCOL_VERSION + 1}; this suite speaks "
                                         rf"{PROTOCOL_VERSION}"):
        optional.protocol_version(Future())


def test_every_capability_is_required_by_some_case_and_none_by_an_alias() -> None:
    rows = collect_rows()
    required = set().union(*(row.requires for row in rows))
    unused = sorted(str(c) for c in set(Capability) - set(DEPRECATED_CAPABILITIES) - required)
    assert not unused, f"capabilities no case requires (an adapter could declare them for nothing): {unused}"
    aliased = sorted({row.row_id for row in rows if row.requires & set(DEPRECATED_CAPABILITIES)})
    assert not aliased, f"cases requiring a deprecated capability: {aliased}"


def test_findings_from_a_file_and_an_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listed = tmp_path / "mine.json"
    listed.write_text(json.dumps([{"impl": "my-fsdp", "rows": "placement/no_params[use_device_id=True]",
                                   "doc": "https://example.org/my-fsdp/issues/1"}]))
    monkeypatch.setenv(ENV_VAR, str(listed))
    assert annotate("my-fsdp", "placement/no_params[use_device_id=True]", "boom") == (
        "known finding, see https://example.org/my-fsdp/issues/1: boom")
    assert annotate("my-fsdp", "placement/no_params[use_device_id=False]", "boom") == "boom"
    listed.write_text(json.dumps([{"impl": "my-fsdp", "rows": "misc/x[bad]", "doc": "d"}]))
    with pytest.raises(ValueError, match=r"is not name=value"):
        annotate("my-fsdp", "misc/x", "boom")
    monkeypatch.delenv(ENV_VAR)
    pkg = fake_distribution(tmp_path / "site", "myfindings", "1.0",
                            "[fsdp_conformance.findings]\nmy-fsdp = myfindings:FINDINGS\n",
                            package=("myfindings", "from conformance.runner.findings import Finding\n"
                                     "FINDINGS = [Finding('my-fsdp', 'checkpoint/*', 'docs/my-fsdp-checkpoint.md')]\n"))
    code = ("from conformance.runner.findings import annotate; "
            "print(annotate('my-fsdp', 'checkpoint/checkpoint_submodule[use_reentrant=True]', 'boom'))")
    proc = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(pkg), "PATH": ""},
                          capture_output=True, text=True, check=False)
    assert proc.stdout.strip() == "known finding, see docs/my-fsdp-checkpoint.md: boom", proc.stderr


def test_a_finding_with_a_reason_explains_only_that_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fuzzer row fails for whatever the fuzzer finds; a finding may claim one cause of it."""
    listed = tmp_path / "mine.json"
    listed.write_text(json.dumps([{"impl": "my-fsdp", "rows": "fuzz/parity_ws1", "doc": "d.md",
                                   "reason": r"has \d+ parameters, the local model \d+"}]))
    monkeypatch.setenv(ENV_VAR, str(listed))
    assert annotate("my-fsdp", "fuzz/parity_ws1", "step 0: has 6 parameters, the local model 8") == (
        "known finding, see d.md: step 0: has 6 parameters, the local model 8")
    assert annotate("my-fsdp", "fuzz/parity_ws1", "step 0: grads differ") == "step 0: grads differ"
    listed.write_text(json.dumps([{"impl": "my-fsdp", "rows": "fuzz/parity_ws1", "doc": "d.md", "reason": "("}]))
    with pytest.raises(ValueError, match=r"reason '\(' is not a regular expression"):
        annotate("my-fsdp", "fuzz/parity_ws1", "boom")
    listed.write_text(json.dumps([{"impl": "my-fsdp", "rows": "fuzz/parity_ws1", "doc": "d.md", "why": "x"}]))
    with pytest.raises(ValueError, match=r"optionally 'reason', 'component', 'kind', 'documentation' and 'set_aside'"):
        annotate("my-fsdp", "fuzz/parity_ws1", "boom")


@pytest.mark.parametrize(("adapter", "capability", "method"), [
    ("ClaimsEvent", "POST_OPTIM_EVENT", "set_post_optim_event"),
    ("ClaimsNoSync", "NO_SYNC", "no_sync"),
])
def test_a_capability_needs_its_method(monkeypatch: pytest.MonkeyPatch, adapter: str, capability: str,
                                       method: str) -> None:
    """An adapter declaring a capability that promises an optional method, without the method, is refused."""
    name = globals()[adapter].name
    monkeypatch.setenv(registry.ENV_VAR, f"{name}={__name__}:{adapter}")
    with pytest.raises(TypeError, match=f"declares Capability.{capability} but has no {method} method"):
        registry.load(name)


class ClaimsEvent(ReferenceAdapter):
    name = "claims-event"
    capabilities = ReferenceAdapter.capabilities | {Capability.POST_OPTIM_EVENT}


class ClaimsNoSync(ProtocolOneAdapter):
    name = "claims-no-sync"
    capabilities = ProtocolOneAdapter.capabilities | {Capability.NO_SYNC}


def test_builtin_adapters_declare_no_deprecated_capability() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in registry.BUILTIN:
            optional.capabilities_of(registry.load(name))


class LacksWrap(ProtocolOneAdapter):
    """Delegates like a protocol-1 adapter, but not ``wrap`` or ``units``."""

    name = "lacks-wrap"

    def __getattr__(self, name: str) -> Any:
        if name in ("wrap", "units"):
            raise AttributeError(name)
        return super().__getattr__(name)


def test_an_adapter_missing_a_required_method_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Members are found as hasattr finds them (delegation through __getattr__ counts), and the missing ones named."""
    monkeypatch.setenv(registry.ENV_VAR, f"lacks-wrap={__name__}:LacksWrap")
    with pytest.raises(TypeError, match=r"'lacks-wrap' .* does not implement FSDPAdapter: missing units, wrap$"):
        registry.load("lacks-wrap")


def test_a_documented_finding_cites_its_documentation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kind="documented"`` needs the citation, and the reason then says the behaviour is documented; a
    ``component`` names the component at fault."""
    listed = tmp_path / "mine.json"
    entry = {"impl": "my-fsdp", "rows": "checkpoint/*", "doc": "d.md", "reason": "needs a GPU"}
    listed.write_text(json.dumps([{**entry, "kind": "documented", "documentation": "my-fsdp 1.0, README: GPU only",
                                   "component": "my-fsdp.offload"}]))
    monkeypatch.setenv(ENV_VAR, str(listed))
    assert annotate("my-fsdp", "checkpoint/x", "rank 0: needs a GPU") == (
        "known finding in my-fsdp.offload, documented limitation (my-fsdp 1.0, README: GPU only), see d.md: "
        "rank 0: needs a GPU")
    for bad in ({**entry, "kind": "documented"}, {**entry, "documentation": "x"}, {**entry, "kind": "wontfix"}):
        listed.write_text(json.dumps([bad]))
        with pytest.raises(ValueError, match=r"mine\.json: (kind must be|'documentation')"):
            annotate("my-fsdp", "checkpoint/x", "boom")


def test_release_calls_the_adapters_method() -> None:
    """``optional.release`` calls an adapter's ``release(model)`` once, with the model it is given."""
    released: list[nn.Module] = []

    class Releasing:
        name = "releasing"

        def release(self, model: nn.Module) -> None:
            released.append(model)

    module = nn.Linear(2, 2)
    optional.release(Releasing(), module)
    assert released == [module]


def test_units_per_module_asks_the_adapter_per_strategy() -> None:
    """``optional.units_per_module`` is the adapter's answer for the strategy it is given."""

    class OneUnitUnsharded:
        name = "one-unit-unsharded"

        def units_per_module(self, strategy: str | None) -> bool:
            return strategy == "FULL_SHARD"

    assert optional.units_per_module(OneUnitUnsharded(), "FULL_SHARD")
    assert not optional.units_per_module(OneUnitUnsharded(), None)


def test_step_zeroes_grads_reads_the_adapters_attribute() -> None:
    """``optional.step_zeroes_grads`` is the adapter's ``step_zeroes_grads``."""

    class ZeroingStep:
        name = "zeroing-step"
        step_zeroes_grads = True

    assert optional.step_zeroes_grads(ZeroingStep())
