"""``fully_shard`` state: meta-device initialization, and ``torch.distributed.checkpoint`` (DCP) round
trips across world sizes and between the reference and torch's ``fully_shard``."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fixtures.parity import COPIED
from fsdp_impl import fully_shard
from fsdp_impl.tests.models import batch, prefixed
from harness.ranks.context import RankContext

IMPLS: dict[str, Callable[..., nn.Module]] = {"reference": fully_shard, "torch": torch_fully_shard}


class _SeededLinear(nn.Linear):
    """A Linear whose ``reset_parameters`` draws the full tensors from a private generator and, for
    DTensor parameters, keeps this rank's rows: layout-independent, so a sharded reset must equal
    an unsharded one."""

    def reset_parameters(self) -> None:
        gen = torch.Generator().manual_seed(100 * self.in_features + self.out_features)
        with torch.no_grad():
            for param in (self.weight, self.bias):
                full = torch.randn(param.shape, generator=gen, device="cpu")
                if isinstance(param, DTensor):
                    full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.copy_(full)


def _net(linear: type[nn.Linear] = nn.Linear) -> nn.Sequential:
    return nn.Sequential(linear(4, 7), nn.Tanh(), linear(7, 5), nn.Tanh(), linear(5, 3))


def _shard(model: nn.Sequential, shard: Callable[..., nn.Module], mesh: DeviceMesh) -> nn.Sequential:
    for layer in model[::2]:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.full_tensor() for name, param in model.named_parameters()}


# -- meta-device initialization ---------------------------------------------------------------
def _meta_body(ctx: RankContext) -> None:
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    # A reset that does not depend on the layout: the sharded model equals the unsharded one.
    local = _net(_SeededLinear)
    with torch.device("meta"):
        meta = _net(_SeededLinear)
    model = _shard(meta, fully_shard, mesh)
    model.to_empty(device="cpu")
    for layer in model[::2]:
        layer.reset_parameters()
    torch.testing.assert_close(_full(model), dict(local.named_parameters()), rtol=0, atol=0,
                               msg=prefixed(f"rank {ctx.rank}: {COPIED}"))
    # It trains on those values: they reached the shards the all-gathers read.
    opt, opt_local = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(local.parameters(), lr=0.1)
    for step in range(3):
        xs = [batch(step, rank) for rank in range(ctx.world_size)]
        loss = model(xs[ctx.rank]).sum()
        loss.backward()
        (sum(local(x).sum() for x in xs) / ctx.world_size).backward()
        opt.step(), opt_local.step()
        opt.zero_grad(), opt_local.zero_grad()
    torch.testing.assert_close(_full(model), dict(local.named_parameters()), msg=prefixed(f"rank {ctx.rank}: trained"))
    # nn.Linear's own random reset on DTensors: whatever torch's fully_shard gets (on a CPU mesh
    # DTensor draws each rank's rows from the global generator), the reference gets bit for bit.
    locals_ = {}
    for impl, shard in IMPLS.items():
        with torch.device("meta"):
            meta = _net()
        model = _shard(meta, shard, mesh)
        with ctx.rng(1234):
            model.to_empty(device="cpu")
            for layer in model[::2]:
                layer.reset_parameters()
        locals_[impl] = {name: param.to_local() for name, param in model.named_parameters()}
    torch.testing.assert_close(locals_["reference"], locals_["torch"], rtol=0, atol=0,
                               msg=prefixed(f"rank {ctx.rank}: same DTensor random ops"))


@pytest.mark.ranks(world_size=2)
def test_meta_device_init(ctx: RankContext) -> None:
    _meta_body(ctx)


# -- DCP ---------------------------------------------------------------------------------------
@contextmanager
def _shared_dir(ctx: RankContext) -> Iterator[str]:
    """A directory every rank of the run writes to and reads from, removed at the end."""
    path = ctx.all_gather_object(tempfile.mkdtemp(prefix="fsdp_dcp_") if ctx.rank == 0 else None)[0]
    try:
        yield path
    finally:
        ctx.barrier()
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _side(ctx: RankContext, size: int, pair: dist.ProcessGroup) -> tuple[DeviceMesh, dist.ProcessGroup]:
    """A mesh of ``size`` ranks holding this one (its pair of ranks, or the world) and its group."""
    if size == ctx.world_size:
        return init_device_mesh("cpu", (size,)), dist.group.WORLD  # type: ignore[return-value]
    return DeviceMesh.from_group(pair, "cpu"), pair


def _net_from(ctx: RankContext, seed: int) -> nn.Sequential:
    """:func:`_net` drawn from the global generator seeded alike on every rank."""
    with ctx.rng(seed):  # holds a process-wide lock under thread ranks: no collectives inside
        return _net()


def _trained(ctx: RankContext, shard: Callable[..., nn.Module], mesh: DeviceMesh) -> nn.Sequential:
    """A sharded model after one step."""
    model = _shard(_net_from(ctx, 0), shard, mesh)
    model(batch(0, ctx.rank)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()
    return model


def _dcp_body(ctx: RankContext, saver: str, loader: str) -> None:
    # Every rank is in one pair (ranks 0-1, 2-3): a checkpoint saved by four ranks is loaded by each
    # pair on its own, one saved by ranks 0-1 by all four.
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][ctx.rank // 2]
    for save_size, load_size in ((4, 2), (2, 4)):
        label = f"{saver} at {save_size} -> {loader} at {load_size}, rank {ctx.rank}"
        with _shared_dir(ctx) as path:
            saved = None
            if save_size == ctx.world_size or ctx.rank < save_size:
                mesh, group = _side(ctx, save_size, pair)
                model = _trained(ctx, IMPLS[saver], mesh)
                saved = _full(model)
                dcp.save(model.state_dict(), checkpoint_id=path, process_group=group)
            saved = ctx.all_gather_object(saved)[0]
            mesh, group = _side(ctx, load_size, pair)
            fresh = _shard(_net_from(ctx, 1), IMPLS[loader], mesh)
            state = fresh.state_dict()
            dcp.load(state, checkpoint_id=path, process_group=group)
            fresh.load_state_dict(state)
            torch.testing.assert_close(_full(fresh), saved, rtol=0, atol=0, msg=prefixed(f"{label}: {COPIED}"))
            # The values are the ones the shards hold: the forward computes with them.
            local = _net()
            local.load_state_dict(saved)
            x = batch(5, ctx.rank)
            torch.testing.assert_close(fresh(x), local(x), msg=prefixed(f"{label}: forward"))


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_dcp_reshards_across_world_sizes(ctx: RankContext) -> None:
    _dcp_body(ctx, "reference", "reference")


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_dcp_between_reference_and_torch(ctx: RankContext) -> None:
    _dcp_body(ctx, "reference", "torch")
    _dcp_body(ctx, "torch", "reference")


@pytest.mark.ranks(world_size=4, modes=("process",))
def test_dcp_process_ranks(ctx: RankContext) -> None:
    _dcp_body(ctx, "reference", "reference")
    _dcp_body(ctx, "torch", "reference")
