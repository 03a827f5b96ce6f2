"""The DeepSpeed ZeRO adapters (an optional extra): what they map, what they refuse, and one 2-rank ZeRO-3 run."""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

import harness
from conformance.adapters.deepspeed_zero import DeepSpeedZero1Adapter, DeepSpeedZero2Adapter, DeepSpeedZero3Adapter
from conformance.contract import optional, registry
from conformance.contract.adapter import MixedPrecisionSpec, WrapSpec
from fixtures.optimizers import OPTIMIZERS, make_optim, wrapped_optim

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NAMES = ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")
STRATEGIES = (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def test_unavailable_without_deepspeed_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    reason = DeepSpeedZero3Adapter().unavailable_reason()
    assert reason is not None and "DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation deepspeed" in reason


def test_all_leaves_out_an_unavailable_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    for name in NAMES:
        assert name in registry.registered()
        assert name not in registry.expand(["all"])
        assert registry.expand([name]) == [name]


def test_each_stage_is_a_column_with_its_own_strategies() -> None:
    """Stages 1 and 2 replicate parameters (None, NO_SHARD); stage 3 shards them (None, FULL_SHARD)."""
    accepted = {a.name: [s for s in STRATEGIES if a.supports_strategy(s)]
                for a in (DeepSpeedZero1Adapter(), DeepSpeedZero2Adapter(), DeepSpeedZero3Adapter())}
    assert accepted == {"deepspeed-zero1": [None, "NO_SHARD"], "deepspeed-zero2": [None, "NO_SHARD"],
                        "deepspeed-zero3": [None, "FULL_SHARD"]}


def test_config_maps_the_stage_and_releases_every_parameter() -> None:
    zero3 = DeepSpeedZero3Adapter().config(WrapSpec(extra={"config": {"gradient_accumulation_steps": 4}}))
    assert zero3["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0,
                                          "stage3_max_reuse_distance": 0}
    assert zero3["gradient_accumulation_steps"] == 4
    assert zero3["gradient_clipping"] == 0.0, "DeepSpeed's default clips to norm 1.0, which a torch step does not"
    assert DeepSpeedZero1Adapter().config(WrapSpec())["zero_optimization"] == {"stage": 1}


def test_units_per_module_at_stage_3_only_and_every_step_zeroes_grads() -> None:
    stages = (DeepSpeedZero1Adapter(), DeepSpeedZero2Adapter(), DeepSpeedZero3Adapter())
    assert [optional.units_per_module(a, None) for a in stages] == [False, False, True]
    assert all(optional.step_zeroes_grads(a) for a in stages)


def test_wrap_refuses_what_it_cannot_express() -> None:
    with pytest.raises(ValueError, match=r"deepspeed-zero3 cannot express \['cpu_offload'\]"):
        DeepSpeedZero3Adapter().wrap(nn.Linear(2, 2), WrapSpec(cpu_offload=True))
    with pytest.raises(ValueError, match="cannot express strategy 'FULL_SHARD'"):
        DeepSpeedZero2Adapter().wrap(nn.Linear(2, 2), WrapSpec())
    with pytest.raises(ValueError, match="does not express MixedPrecisionSpec"):
        DeepSpeedZero3Adapter().wrap(nn.Linear(2, 2), WrapSpec(mixed_precision=MixedPrecisionSpec()))


def _zero3_full_params(ctx: harness.RankContext) -> list[float]:
    adapter = DeepSpeedZero3Adapter()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    expected = {k: v.detach().clone() for k, v in model.named_parameters()}
    engine = adapter.wrap(model, WrapSpec(strategy="FULL_SHARD"))
    units = adapter.units(engine)
    assert [u.fqn for u in units] == ["", "0", "1"]
    assert all(u.resharded for u in units[1:]), "stage3_param_persistence_threshold=0 releases every parameter"
    full = adapter.full_params(engine)
    return [float((full[k] - v).abs().max()) for k, v in expected.items()]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is an optional extra (docs/USAGE.md, 'DeepSpeed ZeRO')")
def test_zero3_gathers_the_parameters_it_partitioned() -> None:
    assert harness.run(_zero3_full_params, world_size=2, mode="process") == [[0.0] * 4] * 2


def _trained_vs_local(ctx: harness.RankContext, stage: int, name: str) -> list[float]:
    """Three steps through the adapter's optimizer and step; the largest gap to a local model's parameters."""
    adapter = {1: DeepSpeedZero1Adapter, 2: DeepSpeedZero2Adapter, 3: DeepSpeedZero3Adapter}[stage]()
    local = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    engine = adapter.wrap(copy.deepcopy(local), WrapSpec(strategy=None))
    optim, local_optim = wrapped_optim(adapter, engine, name), make_optim(name, local.parameters())
    gaps = []
    for step in range(3):
        batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
        engine(batches[ctx.rank]).square().sum().backward()
        (sum(local(b).square().sum() for b in batches) / 2).backward()
        optional.step(adapter, engine, optim)
        local_optim.step()
        optim.zero_grad(set_to_none=True)
        local_optim.zero_grad(set_to_none=True)
        full = adapter.full_params(engine)
        gaps.append(max(float((full[n] - p).abs().max()) for n, p in local.named_parameters()))
    return gaps


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is an optional extra (docs/USAGE.md, 'DeepSpeed ZeRO')")
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_engine_trains_through_the_adapter_optimizer_and_step(stage: int, name: str) -> None:
    gaps = harness.run(_trained_vs_local, world_size=2, mode="process", args=(stage, name))
    assert all(gap < 1e-6 for rank in gaps for gap in rank), gaps


def _loaded_then_stepped(ctx: harness.RankContext) -> float:
    """A ZeRO-3 model trained a step, loaded with another model's state dict and stepped again; the largest gap
    to that other model stepped on the same gradients."""
    adapter = DeepSpeedZero3Adapter()
    torch.manual_seed(0)
    engine = adapter.wrap(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), WrapSpec(strategy="FULL_SHARD"))
    optim = optional.optimizer(adapter, engine, torch.optim.SGD, lr=0.1)
    batch = torch.ones(2, 4)
    engine(batch).sum().backward()
    optional.step(adapter, engine, optim)
    loaded = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    adapter.load_state_dict(engine, copy.deepcopy(loaded.state_dict()), sharded=False)
    engine(batch).sum().backward()
    optional.step(adapter, engine, optim)
    loaded(batch).sum().backward()
    torch.optim.SGD(loaded.parameters(), lr=0.1).step()
    full = adapter.full_params(engine)
    return max(float((full[n] - p).abs().max()) for n, p in loaded.named_parameters())


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is an optional extra (docs/USAGE.md, 'DeepSpeed ZeRO')")
def test_a_loaded_state_survives_the_next_step() -> None:
    """``load_state_dict`` sets the ZeRO optimizer's fp32 master partitions too, which the next step starts from."""
    gaps = harness.run(_loaded_then_stepped, world_size=2, mode="process")
    assert all(gap < 1e-6 for gap in gaps), gaps
