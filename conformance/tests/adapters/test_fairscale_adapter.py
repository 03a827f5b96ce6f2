"""The FairScale adapter (an optional extra): what it maps, what it refuses, and the CPU finding it carries."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

import harness
from conformance.adapters.fairscale_fsdp import FairScaleFSDPAdapter
from conformance.contract import registry
from conformance.contract.adapter import AutoWrap, WrapSpec

HAS_FAIRSCALE = importlib.util.find_spec("fairscale") is not None


def test_unavailable_without_fairscale_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fairscale", None)
    reason = FairScaleFSDPAdapter().unavailable_reason()
    assert reason is not None and "pip install --no-deps fairscale==0.4.13" in reason


def test_all_leaves_out_an_unavailable_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fairscale", None)
    assert "fairscale-fsdp" in registry.registered()
    assert "fairscale-fsdp" not in registry.expand(["all"])
    assert registry.expand(["fairscale-fsdp"]) == ["fairscale-fsdp"]


def test_strategies_and_wrap_arguments() -> None:
    adapter = FairScaleFSDPAdapter()
    assert [s for s in (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
            if adapter.supports_strategy(s)] == [None, "FULL_SHARD", "SHARD_GRAD_OP"]
    kwargs = adapter._kwargs(WrapSpec(strategy="SHARD_GRAD_OP", use_orig_params=True, forward_prefetch=True))
    assert kwargs["reshard_after_forward"] is False and kwargs["flatten_parameters"] is False
    with pytest.raises(ValueError, match=r"fairscale-fsdp cannot express \['cpu_offload', 'sync_module_states'\]"):
        adapter._kwargs(WrapSpec(cpu_offload=True, sync_module_states=True))
    with pytest.raises(ValueError, match="cannot express strategy 'NO_SHARD'"):
        adapter._kwargs(WrapSpec(strategy="NO_SHARD"))


def _train_once(ctx: harness.RankContext) -> str:
    adapter = FairScaleFSDPAdapter()
    model = adapter.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), WrapSpec(auto_wrap=AutoWrap((nn.Linear,))))
    assert len(adapter.units(model)) == 3
    try:
        model(torch.ones(2, 4))
    except KeyError as exc:
        return f"KeyError {exc}"
    return "ran"


@pytest.mark.skipif(not HAS_FAIRSCALE, reason="fairscale is an optional extra: pip install --no-deps fairscale==0.4.13")
def test_cpu_forward_still_needs_cuda_streams() -> None:
    """Pins docs/findings/fairscale-fsdp-needs-cuda.md: when this starts failing, FairScale runs on CPU."""
    if torch.cuda.is_available():
        pytest.skip("the finding is about machines without CUDA")
    assert harness.run(_train_once, world_size=2, mode="process") == ["KeyError 'all_gather'"] * 2
