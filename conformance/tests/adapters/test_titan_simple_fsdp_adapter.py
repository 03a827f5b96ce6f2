"""The torchtitan SimpleFSDP adapter (an optional extra): what it maps, what it refuses, and the findings it carries."""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

import harness
from conformance.adapters.torchtitan_simple_fsdp import TorchTitanSimpleFSDPAdapter
from conformance.contract import registry
from conformance.contract.adapter import MixedPrecisionSpec, WrapSpec

INSTALL = "pip install --no-deps torchtitan==0.3.0 tyro docstring_parser spmd_types"
HAS_TITAN = importlib.util.find_spec("torchtitan") is not None
needs_titan = pytest.mark.skipif(not HAS_TITAN, reason=f"torchtitan is an optional extra: {INSTALL}")


def _hide_torchtitan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torchtitan unimportable, submodules an earlier test imported included."""
    for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")] or ["torchtitan"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_unavailable_without_torchtitan_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_torchtitan(monkeypatch)
    reason = TorchTitanSimpleFSDPAdapter().unavailable_reason()
    assert reason is not None and INSTALL in reason


def test_all_leaves_out_an_unavailable_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_torchtitan(monkeypatch)
    assert "torchtitan-simple-fsdp" in registry.registered()
    assert "torchtitan-simple-fsdp" not in registry.expand(["all"])
    assert registry.expand(["torchtitan-simple-fsdp"]) == ["torchtitan-simple-fsdp"]


@needs_titan
def test_strategies_and_refusals() -> None:
    adapter = TorchTitanSimpleFSDPAdapter()
    assert all(adapter.supports_strategy(s) for s in (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                                      "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"))
    with pytest.raises(ValueError, match=r"cannot express \['cpu_offload', 'sync_module_states'\]"):
        adapter._kwargs(WrapSpec(cpu_offload=True, sync_module_states=True))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))


def _one_step(ctx: harness.RankContext, spec: WrapSpec) -> tuple[float, list[tuple[str, str | None, str]], list[str]]:
    """One forward/backward: SimpleFSDP's gradient over DDP's (the mean), the collectives, the units."""
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    adapter = TorchTitanSimpleFSDPAdapter()
    model = adapter.wrap(copy.deepcopy(local), spec)
    dtype = spec.mixed_precision.param_dtype if spec.mixed_precision is not None else None
    with ctx.record_collectives() as trace:
        model(_batch(ctx.rank).to(dtype or torch.float32)).sum().backward()
    for rank in range(ctx.world_size):
        (local(_batch(rank)).sum() / ctx.world_size).backward()
    grads = adapter.full_grads(model)
    expected = local[0].weight.grad
    assert expected is not None and grads["0.weight"] is not None
    ratio = (grads["0.weight"] / expected).median().item()
    calls = sorted({(c.op, c.reduce_op, c.dtype) for c in trace.calls})
    return ratio, calls, [u.fqn for u in adapter.units(model)]


def _sums_with_functional_collectives(ctx: harness.RankContext) -> tuple[object, ...]:
    return _one_step(ctx, WrapSpec())


@needs_titan
def test_one_step_sums_what_ddp_averages_through_functional_collectives() -> None:
    """Pins docs/findings/titan-simple-fsdp-sums-gradients.md: when the ratio becomes 1, SimpleFSDP averages."""
    for ratio, calls, units in harness.run(_sums_with_functional_collectives, world_size=2, mode="process"):
        assert ratio == pytest.approx(2.0)
        assert calls == [("all_gather_into_tensor", None, "float32"), ("reduce_scatter_tensor", "SUM", "float32")]
        assert units == ["0", "2"]


def _mixed_precision(ctx: harness.RankContext) -> tuple[object, ...]:
    return _one_step(ctx, WrapSpec(mixed_precision=MixedPrecisionSpec(torch.bfloat16, cast_forward_inputs=False)))


@needs_titan
def test_mixed_precision_gathers_and_reduces_in_the_param_dtype() -> None:
    """``reduce_dtype=None`` is the param dtype (the spec's meaning), which the adapter passes on explicitly."""
    for _, calls, _ in harness.run(_mixed_precision, world_size=2, mode="process"):
        assert calls == [("all_gather_into_tensor", None, "bfloat16"), ("reduce_scatter_tensor", "SUM", "bfloat16")]


def _two_wraps(ctx: harness.RankContext) -> tuple[str, str]:
    adapter = TorchTitanSimpleFSDPAdapter()
    spec = WrapSpec(mixed_precision=MixedPrecisionSpec(torch.bfloat16, cast_forward_inputs=False))
    first = adapter.wrap(nn.Linear(4, 4), spec)
    second = adapter.wrap(nn.Linear(4, 4), WrapSpec())
    return str(first.weight.dtype), str(second.weight.dtype)


@needs_titan
def test_each_wrap_uses_its_own_settings() -> None:
    """The adapter's answer to docs/findings/titan-simple-fsdp-class-cache.md (the package's cache is emptied)."""
    assert harness.run(_two_wraps, world_size=2, mode="process") == [("torch.bfloat16", "torch.float32")] * 2


def _state_dicts(ctx: harness.RankContext) -> bool:
    adapter = TorchTitanSimpleFSDPAdapter()
    torch.manual_seed(0)
    model = adapter.wrap(nn.Linear(4, 6), WrapSpec())
    full, sharded = adapter.full_state_dict(model), adapter.sharded_state_dict(model)
    other = adapter.wrap(nn.Linear(4, 6), WrapSpec())
    adapter.load_state_dict(other, full, sharded=False)
    same_full = all(torch.equal(a, b) for a, b in zip(adapter.full_params(other).values(), full.values(), strict=True))
    third = adapter.wrap(nn.Linear(4, 6), WrapSpec())
    adapter.load_state_dict(third, sharded, sharded=True)
    return same_full and all(torch.equal(v, full[k]) for k, v in adapter.full_params(third).items())


@needs_titan
def test_full_and_sharded_state_dicts_round_trip() -> None:
    assert harness.run(_state_dicts, world_size=2, mode="process") == [True, True]
