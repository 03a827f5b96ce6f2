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

- ``submodules[keep_submodule_prefixes=True|False]``: ``get_model_state_dict(model, submodules={b2})`` holds
  exactly ``b2``'s entries, keyed ``b2.<name>`` with the option (the default) and ``<name>`` without, with
  the values of the model before sharding; loaded, into the whole model (prefixes kept, ``strict=False``)
  or into ``b2`` itself (prefixes dropped), ``b2`` takes them and nothing else changes.
- ``flatten_optimizer_state_dict``: after two Adam steps the optimizer state dict is one flat mapping, as
  the docstring of ``torch.distributed.checkpoint.state_dict._flatten_optim_state_dict`` shows it:
  ``state.<param>.<key>`` holds the local optimizer's state and ``param_groups.<param>.<option>`` its
  group's options, for every parameter. A sharded one (``full_state_dict`` off) loaded with the same option
  into a fresh model (with the model's sharded state dict): the next two steps match the local model's.
  A full flattened one is not loaded: torch 2.13's ``set_optimizer_state_dict`` with both
  ``full_state_dict`` and ``flatten_optimizer_state_dict`` fails on a plain module in one process too,
  which is ``torch.distributed.checkpoint.state_dict``'s behaviour, not an FSDP's.
- ``dsd_fqn_modifiers``: a block hidden in a wrapper whose state-dict hooks drop the wrapper's child name
  (``b2.inner.up.weight`` saved as ``b2.up.weight``) and whose method ``renames`` says so, as
  ``StateDictOptions.dsd_fqn_modifiers`` names it (the method's name; ``_fqn_modifiers`` by default, which
  the wrapper does not define; the docstring does not describe the field, its source does): the unsharded
  model's own ``state_dict()``, loaded with the option into the sharded model, gives every parameter its
  value (without the option the sharded model refuses the keys). Only loading is checked: the modifiers
  were added for loading (pytorch/pytorch#146557, "Add fqn_modifier at loading_state_dict"), and torch
  2.13's ``get_model_state_dict`` reads the default method name whatever the option says
  (``_get_model_state_dict`` calls ``_get_fqns`` without it), on any module.

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
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from conformance.contract import optional
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, case
from fixtures.blocks import Block, Blocks
from fixtures.parity import COPIED, assert_close_named
from fixtures.sharded_blocks import full_of, local_step, mesh_over, shard_blocks, sharded_step

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


@case("state_dict_options/submodules", clause="C4", world_size=TWO_OR_MORE, requires=REQUIRES)
@pytest.mark.parametrize("keep_submodule_prefixes", [True, False])
def test_submodules(ctx: RankContext, impl: FSDPAdapter, keep_submodule_prefixes: bool) -> None:
    """A full state dict of ``b2`` alone is keyed with or without its prefix as the option says, holds ``b2``'s
    values before sharding, and loads back into ``b2`` alone."""
    source, target = _sharded(ctx, impl, seed=0), _sharded(ctx, impl, seed=1)
    options = StateDictOptions(full_state_dict=True, keep_submodule_prefixes=keep_submodule_prefixes)
    state = get_model_state_dict(source, submodules={source.b2}, options=options)
    prefix = "b2." if keep_submodule_prefixes else ""
    expected = {f"{prefix}{name[3:]}": value for name, value in _unsharded(0).items() if name.startswith("b2.")}
    assert sorted(state) == sorted(expected), f"rank {ctx.rank}: keys {sorted(state)}, expected {sorted(expected)}"
    assert_close_named(_whole(state), expected, what=f"rank {ctx.rank}: the submodule's state dict", exact=COPIED)
    if keep_submodule_prefixes:
        set_model_state_dict(target, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        set_model_state_dict(target.b2, state, options=FULL)
    after, seed0, seed1 = _full_values(target), dict(Blocks(seed=0).named_parameters()), _unsharded(1)
    assert_close_named(after, {n: (seed0 if n.startswith("b2.") else seed1)[n] for n in after},
                       what=f"rank {ctx.rank}: parameters after loading b2's state dict", exact=COPIED)


def _adam(ctx: RankContext, impl: FSDPAdapter, seed: int) -> tuple[Blocks, torch.optim.Optimizer]:
    model = _sharded(ctx, impl, seed=seed)
    return model, optional.optimizer(impl, model, torch.optim.Adam, lr=1e-2)


@case("state_dict_options/flatten_optimizer_state_dict", clause="C4", world_size=TWO_OR_MORE, requires=REQUIRES)
def test_flatten_optimizer_state_dict(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The flattened full optimizer state dict holds the local optimizer's state and options under
    ``state.<param>.<key>`` / ``param_groups.<param>.<option>``; loaded with the option, training goes on like
    the local model."""
    (model, optim), local = _adam(ctx, impl, seed=0), Blocks(seed=0).to(ctx.device)
    local_optim = torch.optim.Adam(local.parameters(), lr=1e-2)
    ranks = range(ctx.world_size)
    for step in range(2):
        sharded_step(ctx, impl, model, optim, step)
        local_step(ctx, local, local_optim, step, ranks)
    flat_options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    flat = get_optimizer_state_dict(model, optim, options=flat_options)
    names = {id(p): n for n, p in local.named_parameters()}
    state = {f"state.{names[id(p)]}.{k}": v for p, held in local_optim.state.items() for k, v in held.items()}
    group = {k: v for k, v in local_optim.param_groups[0].items() if k != "params"}
    options = {f"param_groups.{n}.{k}": v for n in names.values() for k, v in group.items()}
    assert sorted(flat) == sorted({**state, **options}), (
        f"rank {ctx.rank}: keys {sorted(flat)}, expected {sorted({**state, **options})}")
    assert {k: flat[k] for k in options} == options, f"rank {ctx.rank}: param_groups entries differ from {group}"
    assert_close_named(_whole({k: flat[k] for k in state}), {k: torch.as_tensor(v).cpu() for k, v in state.items()},
                       what=f"rank {ctx.rank}: the flattened optimizer state")
    sharded_flat = StateDictOptions(flatten_optimizer_state_dict=True)
    fresh, fresh_optim = _adam(ctx, impl, seed=1)
    set_model_state_dict(fresh, get_model_state_dict(model))
    set_optimizer_state_dict(fresh, fresh_optim, get_optimizer_state_dict(model, optim, options=sharded_flat),
                             options=sharded_flat)
    for step in range(2, 4):
        sharded_step(ctx, impl, fresh, fresh_optim, step)
        local_step(ctx, local, local_optim, step, ranks)
    assert_close_named(_full_values(fresh), {n: p.detach().cpu() for n, p in local.named_parameters()},
                       what=f"rank {ctx.rank}: parameters two steps after loading the flattened state")


class _Hidden(nn.Module):
    """A block held as ``inner`` whose state-dict hooks leave ``inner.`` out of its keys; ``renames`` tells
    ``torch.distributed.checkpoint.state_dict`` so (saved name after the hidden level -> the hidden child)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.inner = block
        self.register_state_dict_post_hook(_drop_inner)
        self.register_load_state_dict_pre_hook(_add_inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]

    def renames(self) -> dict[str, str]:
        return {name: "inner" for name, _ in self.inner.named_children()}


def _drop_inner(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state if k.startswith(f"{prefix}inner.")]:
        state[f"{prefix}{key[len(prefix) + len('inner.'):]}"] = state.pop(key)


def _add_inner(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(f"{prefix}inner.")]:
        state[f"{prefix}inner.{key[len(prefix):]}"] = state.pop(key)


def _hidden(ctx: RankContext, impl: FSDPAdapter | None, seed: int) -> Blocks:
    """``Blocks`` with ``b2`` held in a :class:`_Hidden`; sharded as :func:`shard_blocks` does with ``impl``."""
    model = Blocks(seed=seed).to(ctx.device)
    model.b2 = _Hidden(model.b2)  # type: ignore[assignment]
    return model if impl is None else shard_blocks(impl, model, mesh_over(ctx))


@case("state_dict_options/dsd_fqn_modifiers", clause="C4", world_size=TWO_OR_MORE, requires=REQUIRES)
def test_dsd_fqn_modifiers(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The unsharded model's own ``state_dict()``, keyed as its hooks rename it, loads with
    ``dsd_fqn_modifiers="renames"`` into the sharded model, whose every parameter then has its value."""
    model, local = _hidden(ctx, impl, seed=1), _hidden(ctx, None, seed=0)
    state = local.state_dict()
    assert "b2.up.weight" in state, f"rank {ctx.rank}: the hooks did not rename b2's keys: {sorted(state)}"
    result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                         dsd_fqn_modifiers="renames"))
    assert not result.missing_keys and not result.unexpected_keys, f"rank {ctx.rank}: {result}"
    assert_close_named(_full_values(model), {n: p.detach().cpu() for n, p in local.named_parameters()},
                       what=f"rank {ctx.rank}: parameters after loading the renamed state dict", exact=COPIED)
