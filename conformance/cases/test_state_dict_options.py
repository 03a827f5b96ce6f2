"""state_dict_options: ``torch.distributed.checkpoint.state_dict``'s ``StateDictOptions`` on a sharded model.

Each row shards :class:`fixtures.blocks.Blocks` (every block its own unit, then the root) and calls
``get_model_state_dict`` / ``set_model_state_dict`` / ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` with one option, checking what torch 2.13's ``StateDictOptions`` docstring
promises of it, in values a user reads:

- ``cpu_offload_full``: ``full_state_dict`` and ``cpu_offload``: rank 0 gets every parameter and buffer,
  whole, on the CPU, equal to the sharded model's full values; every other rank gets an empty dict ("only
  the rank0 will get the state_dict").
- ``ignore_frozen_params``: a frozen block's parameters are left out, and only they.
- ``broadcast_from_rank0``: only rank 0 holds the full state dict; after the load every rank's model has
  its values, bit for bit.
- ``strict``: a sharded state dict without ``head.weight`` loads with ``strict=False``, reporting that
  key missing and leaving it as it was while every other value loads; with ``strict=True`` (the default)
  the load refuses it, naming the key.

``strict`` is checked on sharded state dicts: with ``full_state_dict=True`` torch 2.13's
``set_model_state_dict`` neither refuses nor reports a missing key (pytorch/pytorch#153350, open), on a
plain module in one process too. That is ``torch.distributed.checkpoint.state_dict``'s behaviour, not an
FSDP's, and no row asserts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, case
from fixtures.blocks import Blocks
from fixtures.parity import COPIED, assert_close_named
from fixtures.sharded_blocks import full_of, mesh_over, shard_blocks

if TYPE_CHECKING:
    from harness import RankContext

REQUIRES = [Capability.FULLY_SHARD, Capability.DCP_RESHARD]
FULL = StateDictOptions(full_state_dict=True)


def _sharded(ctx: RankContext, impl: FSDPAdapter, seed: int, frozen: tuple[str, ...] = ()) -> Blocks:
    model = Blocks(seed=seed).to(ctx.device)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(frozen) if frozen else True)
    return shard_blocks(impl, model, mesh_over(ctx))


def _whole(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu() for name, value in state.items()}


def _full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.cpu() for name, value in full_of(model).items()}


def _unsharded(seed: int) -> dict[str, torch.Tensor]:
    """What a model built with ``seed`` holds before sharding: the values a state dict of it must give."""
    return {name: value.detach().clone() for name, value in Blocks(seed=seed).state_dict().items()}


@case("state_dict_options/cpu_offload_full", clause="C4", world_size=TWO_OR_MORE, requires=REQUIRES)
def test_cpu_offload_full(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``full_state_dict`` with ``cpu_offload``: rank 0 gets every value whole on the CPU, those of the model
    before sharding; the others get nothing."""
    model = _sharded(ctx, impl, seed=0)
    offloaded = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state: dict[str, Any] = get_model_state_dict(model, options=offloaded)
    if ctx.rank != 0:
        assert state == {}, f"rank {ctx.rank}: expected an empty state dict, got keys {sorted(state)}"
        return
    devices = {name: value.device.type for name, value in state.items() if value.device.type != "cpu"}
    assert not devices, f"rank 0: values not on the CPU: {devices}"
    assert all(type(value) is torch.Tensor for value in state.values()), "rank 0: a value is not a plain tensor"
    assert_close_named(_whole(state), _unsharded(0), what="rank 0: offloaded full state dict", exact=COPIED)


@case("state_dict_options/ignore_frozen_params", clause="C18", world_size=TWO_OR_MORE, requires=REQUIRES)
def test_ignore_frozen_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A frozen block's parameters are left out of the state dict with ``ignore_frozen_params``, and only they."""
    model = _sharded(ctx, impl, seed=0, frozen=("b2.",))
    every = get_model_state_dict(model, options=FULL)
    kept = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    frozen = sorted(name for name in every if name.startswith("b2."))
    assert frozen, f"rank {ctx.rank}: the frozen block has no entries to leave out: {sorted(every)}"
    assert sorted(kept) == sorted(set(every) - set(frozen)), (
        f"rank {ctx.rank}: expected every key but {frozen}, got {sorted(kept)}")
    assert_close_named(_whole(kept), {n: v for n, v in _whole(every).items() if n in kept},
                       what=f"rank {ctx.rank}: the values kept", exact=COPIED)


@case("state_dict_options/broadcast_from_rank0", clause="C6", world_size=TWO_OR_MORE, requires=REQUIRES)
def test_broadcast_from_rank0(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A full state dict only rank 0 holds, loaded with ``broadcast_from_rank0``, gives every rank its values."""
    source, target = _sharded(ctx, impl, seed=0), _sharded(ctx, impl, seed=1)
    state = get_model_state_dict(source, options=FULL)
    held = state if ctx.rank == 0 else {}
    set_model_state_dict(target, held, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_close_named(_full_values(target), dict(Blocks(seed=0).named_parameters()),
                       what=f"rank {ctx.rank}: parameters after loading rank 0's state dict", exact=COPIED)


@case("state_dict_options/strict", clause="C4", world_size=TWO_OR_MORE, requires=REQUIRES)
@pytest.mark.parametrize("strict", [True, False])
def test_strict(ctx: RankContext, impl: FSDPAdapter, strict: bool) -> None:
    """A sharded state dict without ``head.weight``: refused naming the key with ``strict``; without, the key is
    reported missing and keeps its value while every other value loads."""
    source, target = _sharded(ctx, impl, seed=0), _sharded(ctx, impl, seed=1)
    before, loaded = dict(Blocks(seed=1).named_parameters()), dict(Blocks(seed=0).named_parameters())
    state = {name: value for name, value in get_model_state_dict(source).items() if name != "head.weight"}
    options = StateDictOptions(strict=strict)
    if strict:
        with pytest.raises(RuntimeError, match="head.weight"):
            set_model_state_dict(target, state, options=options)
        return
    result = set_model_state_dict(target, state, options=options)
    assert list(result.missing_keys) == ["head.weight"] and not result.unexpected_keys, (
        f"rank {ctx.rank}: expected head.weight missing and nothing unexpected, got {result}")
    after = _full_values(target)
    assert_close_named({"head.weight": after.pop("head.weight")}, {"head.weight": before["head.weight"]},
                       what=f"rank {ctx.rank}: the missing key's value", exact=COPIED)
    assert_close_named(after, {n: v for n, v in loaded.items() if n != "head.weight"},
                       what=f"rank {ctx.rank}: the values loaded", exact=COPIED)
