"""dcp: a ``torch.distributed.checkpoint`` checkpoint saved on one mesh size loads on another.

- ``reshard[sizes=4to2|2to4, loader=self|other]`` (4 ranks): :class:`fixtures.blocks.Blocks`,
  every block a unit under the root, sharded over the first size of ranks (by ``fully_shard``
  where the implementation declares it, bottom-up, else by ``wrap`` with that plan and the
  original parameters exposed: DCP needs no particular sharding API), trains two Adam steps;
  its model and optimizer state (``get_state_dict``) are saved with ``dcp.save``. A model of the
  second size (sharded by the row's implementation, ``self``, or by ``other``: torch-fsdp2 for the
  reference, the reference for everyone else) built from other values loads them (``dcp.load``,
  ``set_state_dict``). Its parameters then equal the saver's bit for bit, and two more steps later
  they equal a local model trained on the same four steps: the checkpoint carried the optimizer's
  moments too. A mesh of 2 is ranks 0-1 or 2-3, each pair loading on its own; a mesh of 4 is the
  world. Each step's global batch is four rows, split evenly over the mesh, and each rank's loss is
  its rows' mean, so every mesh size trains on the same global loss.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from conformance.contract import optional, registry
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import Exact, case, not_applicable
from fixtures.blocks import DIM, Blocks
from fixtures.parity import COPIED, assert_close_named
from fixtures.seeding import generator
from fixtures.sharded_blocks import full_of, mesh_over, shard_blocks

if TYPE_CHECKING:
    from harness import RankContext

REQUIRES = [Capability.DCP_RESHARD]
#: Every block a unit under the root, for an implementation sharding through ``wrap``.
BLOCK_UNITS = AutoWrap(kind="module_names", module_names=("b1", "b2", "b3"))
ROWS = 4
SIZES = {"4to2": (4, 2), "2to4": (2, 4)}


@contextmanager
def _shared_dir(ctx: RankContext) -> Iterator[str]:
    """A directory rank 0 makes and every rank uses, removed when all are done."""
    path = ctx.all_gather_object(tempfile.mkdtemp(prefix="fsdp_conformance_dcp_") if ctx.rank == 0 else None)[0]
    try:
        yield path
    finally:
        ctx.barrier()
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _loss(model: nn.Module, step: int, part: int, parts: int, device: torch.device) -> torch.Tensor:
    """The mean over part ``part`` of ``parts`` of step ``step``'s global batch."""
    rows = torch.randn(ROWS, DIM, generator=generator(100 + step)).to(device)
    per = ROWS // parts
    return model(rows[part * per : (part + 1) * per]).square().mean()


def _train(impl: FSDPAdapter | None, model: nn.Module, optim: torch.optim.Optimizer, steps: range, part: int,
           parts: int, device: torch.device) -> None:
    """Steps of ``model``, wrapped by ``impl`` (``None``: a plain local module)."""
    for step in steps:
        optim.zero_grad(set_to_none=True)
        _loss(model, step, part, parts, device).backward()
        if impl is None:
            optim.step()
        else:
            optional.step(impl, model, optim)


def _side(ctx: RankContext, size: int, pairs: list[dist.ProcessGroup]) -> tuple[dist.ProcessGroup | None, int]:
    """This rank's group of ``size`` ranks (None: the world) and this rank's place in it."""
    if size == ctx.world_size:
        return None, ctx.rank
    return pairs[ctx.rank // 2], ctx.rank % 2


def _sharded(ctx: RankContext, impl: FSDPAdapter, seed: int, group: dist.ProcessGroup | None) -> nn.Module:
    """``Blocks(seed)``, every block a unit under the root, sharded over ``group`` (see the module docstring)."""
    model = Blocks(seed=seed).to(ctx.device)
    if Capability.FULLY_SHARD in impl.capabilities:
        return shard_blocks(impl, model, mesh_over(ctx, group))
    return impl.wrap(model, WrapSpec(auto_wrap=BLOCK_UNITS, process_group=group, use_orig_params=True))


def _full(impl: FSDPAdapter, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective): gathered from a ``fully_shard``-ed model's DTensors, else the adapter's."""
    return full_of(model) if Capability.FULLY_SHARD in impl.capabilities else impl.full_params(model)


def _loader(impl: FSDPAdapter, loader: str, rank_mode: str) -> FSDPAdapter:
    if loader == "self":
        return impl
    other = registry.load("torch-fsdp2" if impl.name == "reference" else "reference")
    reason = other.unavailable_reason()
    if reason is not None:
        not_applicable(f"loading implementation {other.name} unavailable: {reason}")
    needs = set(REQUIRES) | ({Capability.THREAD_RANKS} if rank_mode == "thread" else set())
    missing = sorted(str(c) for c in needs - set(other.capabilities))
    if missing:
        not_applicable(f"loading implementation {other.name} lacks {', '.join(missing)}")
    return other


def _save(ctx: RankContext, impl: FSDPAdapter, size: int, pairs: list[dist.ProcessGroup], path: str) -> Any:
    """Ranks of the saving mesh train two steps and save; every rank gets the saver's parameters."""
    saved = None
    if size == ctx.world_size or ctx.rank < size:
        group, part = _side(ctx, size, pairs)
        model = _sharded(ctx, impl, 0, group)
        optim = optional.optimizer(impl, model, torch.optim.Adam, lr=1e-2)
        _train(impl, model, optim, range(2), part, size, ctx.device)
        model_state, optim_state = get_state_dict(model, optim)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path, process_group=group)
        saved = {name: value.cpu() for name, value in _full(impl, model).items()}
    return ctx.all_gather_object(saved)[0]


@case("dcp/reshard", clause="C5", requires=REQUIRES, uses=[Capability.FULLY_SHARD], timeout_s=240,
      world_size=Exact(4, reason="saves on 4 ranks and loads on the pairs [0, 1], [2, 3], and back"))
@pytest.mark.parametrize("loader", ["self", "other"])
@pytest.mark.parametrize("sizes", list(SIZES))
def test_reshard(ctx: RankContext, impl: FSDPAdapter, sizes: str, loader: str) -> None:
    """Saved with DCP on a mesh of one size and loaded on the other (by this or the other implementation):
    parameters equal the saver's bit for bit, and two Adam steps later equal a local model's."""
    loading = _loader(impl, loader, str(ctx.mode))
    save_size, load_size = SIZES[sizes]
    pairs = [ctx.new_group([0, 1]), ctx.new_group([2, 3])]
    label = f"rank {ctx.rank}: {impl.name} at {save_size} -> {loading.name} at {load_size}"
    with _shared_dir(ctx) as path:
        saved = _save(ctx, impl, save_size, pairs, path)
        group, part = _side(ctx, load_size, pairs)
        model = _sharded(ctx, loading, 1, group)
        optim = optional.optimizer(loading, model, torch.optim.Adam, lr=1e-2)
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = {name: value.cpu() for name, value in _full(loading, model).items()}
    assert_close_named(loaded, saved, what=f"{label}: parameters after load", exact=COPIED)
    _train(loading, model, optim, range(2, 4), part, load_size, ctx.device)
    local = Blocks(seed=0).to(ctx.device)
    _train(None, local, torch.optim.Adam(local.parameters(), lr=1e-2), range(4), 0, 1, ctx.device)
    assert_close_named(_full(loading, model), dict(local.named_parameters()),
                       what=f"{label}: parameters two steps after load vs an unsaved local run")

