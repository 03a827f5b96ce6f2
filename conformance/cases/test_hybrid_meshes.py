"""hybrid_meshes: hybrid sharding over every (shard, replicate) shape of a 4-rank world.

[Note: hybrid mesh shapes]
``hybrid_shard`` covers one layout, 2 "nodes" of 2 ranks. Here the same
training run is repeated for each shape ``S x R`` (shard group size x
replicate group size) of the 4 ranks:

    2x2   shard [0, 1] [2, 3]      replicate [0, 2] [1, 3]
    4x1   shard [0, 1, 2, 3]       replicate [0] [1] [2] [3]   (FULL_SHARD in hybrid form)
    1x4   shard [0] [1] [2] [3]    replicate [0, 1, 2, 3]      (plain data parallelism)

given either as a ``(shard_group, replicate_group)`` tuple or as a 2-D
``(replicate, shard)`` device mesh, with ``HYBRID_SHARD`` and
``_HYBRID_SHARD_ZERO2`` (FSDP2: a 2-D mesh with or without resharding after
forward, see [Note: FSDP2 strategy mapping] in the torch-fsdp2 adapter).

After every step: each rank's loss is the baseline's loss on that rank's batch,
the full parameters equal the baseline's (a local model trained on every
rank's batch, loss averaged over ranks, as data parallelism averages
gradients), and every rank holds the same local shards as the other ranks of
its replicate group, bit for bit (replicas apply the same reduced gradient).
Before training, the ranks of a shard group hold different pieces (the model
is sharded, not replicated, over the shard dimension); after it, every unit
reports the shard and replicate groups of the shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, UnitInfo, WrapSpec
from conformance.contract.case import Exact, case
from conformance.contract.results import CaseReport
from fixtures.baselines import cached
from fixtures.meshes import hybrid_groups, hybrid_ranks
from fixtures.optimizers import make_optim, wrapped_optim
from fixtures.parity import assert_close_named, assert_close_seq, assert_differs_across_ranks, assert_same_across_ranks
from fixtures.seeding import generator, rank_seed, seeded_init_

if TYPE_CHECKING:
    from harness import RankContext

WORLD = 4
#: shape id -> (shard group size, replicate group size); see [Note: hybrid mesh shapes].
SHAPES: dict[str, tuple[int, int]] = {"2x2": (2, 2), "4x1": (4, 1), "1x4": (1, 4)}
STEPS = 3
SHAPES_OF_4 = Exact(WORLD, reason="the shard x replicate shapes 2x2, 4x1 and 1x4 of a 4-rank world")


class ReplicaModel(nn.Module):
    """A unit ``body`` (two linears) under a root that owns ``head`` itself."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
        self.head = nn.Linear(6, 3)
        seeded_init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn((2, 6), generator=generator(rank_seed(10 + step, rank)))


def shape_groups(ctx: RankContext, shard: int, replicate: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ``(shard, replicate)`` groups for a ``replicate x shard`` world ([Note: hybrid layout])."""
    assert replicate == WORLD // shard
    return hybrid_groups(ctx, shard)


def expected_ranks(rank: int, shard: int) -> tuple[list[int], list[int]]:
    """``(shard ranks, replicate ranks)`` of ``rank`` when shard groups have ``shard`` ranks."""
    return hybrid_ranks(rank, WORLD, shard)


def _requires(params: Mapping[str, Any]) -> list[Capability]:
    return [Capability.HYBRID_VIA_PG_TUPLE if params["given"] == "groups" else Capability.DEVICE_MESH]


def _wrap(ctx: RankContext, impl: FSDPAdapter, strategy: str, shape: tuple[int, int], given: str) -> tuple[
    nn.Module, dist.ProcessGroup
]:
    """The wrapped model and this rank's replicate group."""
    shard, replicate = shape
    spec = WrapSpec(strategy=strategy, auto_wrap=AutoWrap((nn.Sequential,)), use_orig_params=True)
    module = ReplicaModel(seed=0).to(ctx.device)
    if given == "groups":
        groups = shape_groups(ctx, shard, replicate)
        return impl.wrap(module, replace(spec, process_group=groups)), groups[1]
    mesh = ctx.device_mesh((replicate, shard), ("replicate", "shard"))
    return impl.wrap(module, replace(spec, device_mesh=mesh)), mesh.get_group("replicate")


def _local_shards(impl: FSDPAdapter, model: nn.Module) -> list[torch.Tensor]:
    return [s.detach().reshape(-1) for u in impl.units(model) for s in u.local_shards]


def _baseline_run(device: torch.device) -> list[tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    """The local model trained ``STEPS`` steps on every rank's batch (mean of the ranks' losses): per step,
    each rank's loss and the parameters after the step. Rows share it ([Note: baseline cache])."""
    local = ReplicaModel(seed=0).to(device)
    optim = make_optim("SGD", local.parameters())
    trajectory = []
    for step in range(STEPS):
        optim.zero_grad()
        losses = [local(_batch(step, r).to(device)).sum() for r in range(WORLD)]
        torch.stack(losses).mean().backward()
        optim.step()
        trajectory.append(([loss.detach() for loss in losses],
                           {name: p.detach().clone() for name, p in local.named_parameters()}))
    return trajectory


def _check_unit_groups(ctx: RankContext, units: list[UnitInfo], shape: tuple[int, int]) -> None:
    """Units owning parameters shard and replicate over the shape's groups (a replicate
    group of one rank may also be reported as none)."""
    want_shard, want_replicate = expected_ranks(ctx.rank, shape[0])
    owning = [u for u in units if u.local_shards]
    assert owning, "no unit owns parameters"
    for unit in owning:
        shard = dist.get_process_group_ranks(unit.shard_group) if unit.shard_group is not None else None
        replicate = None if unit.replicate_group is None else dist.get_process_group_ranks(unit.replicate_group)
        ok_replicate = replicate == want_replicate or (replicate is None and len(want_replicate) == 1)
        assert shard == want_shard and ok_replicate, (
            f"rank {ctx.rank} unit {unit.fqn!r}: (shard, replicate) ranks ({shard}, {replicate}), "
            f"expected ({want_shard}, {want_replicate}) for shape {shape[0]}x{shape[1]}"
        )


@case("hybrid_meshes/replicas_match_baseline", clause=("C15", "C1"), world_size=SHAPES_OF_4, requires=_requires)
@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@pytest.mark.parametrize("given", ["groups", "mesh"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_replicas_match_baseline(
    ctx: RankContext, impl: FSDPAdapter, shape: str, given: str, strategy: str
) -> CaseReport:
    """For every (shard, replicate) shape, given as groups or a mesh: shards differ within a shard group,
    each step's loss and full params equal a local model trained on every rank's data, local shards stay
    identical across the replicate group, and units report the shape's groups."""
    size = SHAPES[shape]
    model, replicate_group = _wrap(ctx, impl, strategy, size, given)
    if size[0] > 1:
        assert_differs_across_ranks(
            torch.cat(_local_shards(impl, model)), what=f"{shape} local shards in one shard group",
            group=shape_groups(ctx, *size)[0],
        )
    baseline = cached("local-steps", {"model": ReplicaModel, "seed": 0, "optim": "SGD", "steps": STEPS,
                                      "world": WORLD, "batch": _batch, "device": ctx.device},
                      lambda: _baseline_run(ctx.device))
    optim = wrapped_optim(impl, model, "SGD")
    for step, (want_losses, want_params) in enumerate(baseline):
        optim.zero_grad()
        loss = model(_batch(step, ctx.rank).to(ctx.device)).sum()
        loss.backward()
        optional.step(impl, model, optim)
        where = f"rank {ctx.rank} {shape} ({given}, {strategy}) step {step}"
        assert_close_seq([loss.detach()], [want_losses[ctx.rank]], what=f"{where}: loss vs baseline")
        assert_close_named(impl.full_params(model), want_params, what=f"{where}: full params vs baseline")
        assert_same_across_ranks(
            _local_shards(impl, model), what=f"{where}: local shards across the replicate group",
            group=replicate_group,
        )
    _check_unit_groups(ctx, impl.units(model), size)
    return CaseReport(reason=f"mesh {size[1]} replica{'s' * (size[1] > 1)} x {size[0]} shard{'s' * (size[0] > 1)}",
                      metrics={"mesh_replicas": size[1], "mesh_shards": size[0]})
