"""An adapter that owns the optimizer and the step gets the same verdicts as one that does not.

The adapter under test is the reference with an engine-style optimizer: what
``optimizer(model, cls, **kwargs)`` returns refuses ``step()`` (an engine
steps its partitions itself, as DeepSpeed's does), and the adapter's
``step(model, optim)`` takes the step. A case or fuzzer that built its own
torch optimizer over a wrapped model, or stepped one directly, fails its row;
one going through :mod:`conformance.contract.optional` passes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional, registry
from conformance.runner import cli
from conformance.tests.installed import fake_distribution
from harness.tests.inprocess import MainResult, run_main

ADAPTER = '''
from conformance.adapters.reference import ReferenceAdapter


class EngineOptimizer:
    """A torch optimizer held by an engine: zero_grad, state and its state dicts as torch's; step refuses."""

    def __init__(self, inner):
        self.inner = inner

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self):
        raise RuntimeError("the engine steps: call the adapter's step(model, optim)")

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state


class EngineAdapter(ReferenceAdapter):
    name = "engine-optimizer"

    def optimizer(self, model, cls, **kwargs):
        return EngineOptimizer(cls(model.parameters(), **kwargs))

    def step(self, model, optim):
        optim.inner.step()

    def optim_state_dict(self, model, optim, *, sharded):
        return super().optim_state_dict(model, optim.inner, sharded=sharded)

    def load_optim_state_dict(self, model, optim, state, *, sharded):
        super().load_optim_state_dict(model, optim.inner, state, sharded=sharded)
'''

#: Rows that train a wrapped model: cases through fixtures, a case with its own loop, the parity and
#: stateful fuzzers, and a state dict round trip handing the optimizer back to the adapter.
SELECTION = "clip_grad_norm or roundtrip or after_forward or accumulate or parity_ws2 or stateful_ws2"


class _Counting:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def optimizer(self, model: nn.Module, cls: type[torch.optim.Optimizer], **kwargs: object) -> object:
        self.calls.append(("optimizer", (cls, kwargs)))
        return cls(model.parameters(), **kwargs)  # type: ignore[arg-type]

    def step(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.calls.append(("step", optim))


class _Plain:
    name = "plain"


def test_defaults_are_torch_optimizer_and_its_step() -> None:
    model = nn.Linear(2, 2)
    optim = optional.optimizer(_Plain(), model, torch.optim.SGD, lr=1.0)
    assert isinstance(optim, torch.optim.SGD) and optim.param_groups[0]["lr"] == 1.0
    assert [id(p) for p in optim.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    optional.step(_Plain(), model, optim)
    assert not torch.equal(model.weight, before), "the default step did not step the optimizer"


def test_an_adapter_method_replaces_each_default() -> None:
    adapter, model = _Counting(), nn.Linear(2, 2)
    optim = optional.optimizer(adapter, model, torch.optim.Adam, lr=0.5)
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    optional.step(adapter, model, optim)
    assert adapter.calls == [("optimizer", (torch.optim.Adam, {"lr": 0.5})), ("step", optim)]
    assert torch.equal(model.weight, before), "optim.step() ran beside the adapter's step"


@pytest.mark.parametrize("cls", [nn.Linear, "SGD", None])
def test_an_optimizer_class_is_required(cls: object) -> None:
    with pytest.raises(TypeError, match=repr(cls).replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        optional.optimizer(_Plain(), nn.Linear(2, 2), cls)  # type: ignore[arg-type]


def _cli(*args: str) -> MainResult:
    return run_main(cli.main, *args)


@pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]
def test_training_rows_pass_through_the_adapter_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = fake_distribution(tmp_path / "site", "engine-optimizer-fsdp", "0.1",
                             "[fsdp_conformance.adapters]\nengine-optimizer = engine_optimizer_fsdp:EngineAdapter\n",
                             package=("engine_optimizer_fsdp", ADAPTER))
    assert "engine-optimizer" not in registry.registered()
    for name in [name for name in os.environ if name.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.syspath_prepend(site)
    out = tmp_path / "r.json"
    run = _cli("run", "--impl", "engine-optimizer", "--rank-mode", "both", "-n", "0", "--fuzz-examples", "2",
               "--fuzz-stateful-examples", "1", "-k", SELECTION, "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    failed = [(r["case"], r["reason"][:300]) for r in rows if r["outcome"] not in ("pass", "n/a", "skip")]
    assert not failed, failed
    passed = {r["case"].split("[")[0] for r in rows if r["outcome"] == "pass"}
    assert {"grad_clip/clip_grad_norm", "state_dict/roundtrip", "reshard/after_forward",
            "grad_accumulation/accumulate", "fuzz/parity_ws2", "fuzz/stateful_ws2"} <= passed, passed
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
