"""``UnitInfo`` says which local shards are empty, and cases read gradients of the others only."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import harness
from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.contract.adapter import UnitInfo, WrapSpec


def _unit(shards: list[torch.Tensor], grads: list[torch.Tensor | None], empty: list[bool] | None) -> UnitInfo:
    return UnitInfo("u", nn.Linear(1, 1), None, None, None, shards, grads, None, empty_shards=empty)


def test_held_grads_skip_declared_empty_shards() -> None:
    padding, real = torch.zeros(2), torch.ones(2)
    unit = _unit([padding, real], [None, real], [True, False])
    assert unit.held_grads() == [real]


def test_without_a_declaration_a_zero_element_shard_is_the_empty_one() -> None:
    real = torch.ones(2)
    assert _unit([torch.empty(0), real], [None, None], None).held_grads() == [None]
    assert _unit([torch.zeros(2)], [None], None).held_grads() == [None], "a shard with elements says no gradient"


def test_empty_shards_must_align_with_the_shards() -> None:
    with pytest.raises(ValueError, match="empty_shards has 1 entries for 2 local shards"):
        _unit([torch.ones(1), torch.ones(1)], [None, None], [False])


def _empty_shards(ctx: harness.RankContext, name: str) -> list[list[bool] | None]:
    """A unit of one 1-element parameter over two ranks: rank 1's flat shard is padding only."""
    impl = ReferenceAdapter() if name == "reference" else TorchFSDP1Adapter()
    with ctx.rng(0):
        model = impl.wrap(nn.Linear(1, 1, bias=False), WrapSpec(device_id=torch.device("cpu")))
    model(torch.ones(1, 1)).sum().backward()
    return [unit.empty_shards for unit in impl.units(model)]


@pytest.mark.parametrize("name", ["reference", "torch-fsdp1"])
def test_flat_parameter_adapters_mark_a_padding_only_shard(name: str) -> None:
    assert harness.run(_empty_shards, world_size=2, mode="process", args=(name,)) == [[[False]], [[True]]]
