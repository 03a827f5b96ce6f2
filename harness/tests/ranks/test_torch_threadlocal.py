"""Pins what the harness relies on in torch's internal threaded process group.

If a torch upgrade breaks one of these, thread ranks are broken: fix
``harness/ranks/_torch_threadlocal.py`` (or replace it) before anything else.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness
from harness.tests import compat


def _collectives(ctx: harness.RankContext) -> dict[str, list[float]]:
    r, w = ctx.rank, ctx.world_size
    out: dict[str, list[float]] = {}
    for op in ("SUM", "AVG", "MAX", "MIN"):
        t = torch.tensor([float(r + 1)])
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[op] = t.tolist()
    full = torch.empty(2 * w)
    compat.all_gather_single(full, torch.full((2,), float(r)))
    out["all_gather_single"] = full.tolist()
    parts = [torch.empty(1) for _ in range(w)]
    dist.all_gather(parts, torch.tensor([float(r)]))
    out["all_gather"] = [p.item() for p in parts]
    shard = torch.empty(1)
    compat.reduce_scatter_single(shard, torch.arange(w, dtype=torch.float32))
    out["reduce_scatter_single"] = shard.tolist()
    listed = torch.empty(1)
    dist.reduce_scatter(listed, [torch.tensor([float(i)]) for i in range(w)])
    out["reduce_scatter"] = listed.tolist()
    b = torch.tensor([float(r)])
    dist.broadcast(b, src=w - 1)
    out["broadcast"] = b.tolist()
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    out["async_completed"] = [float(work.is_completed())]
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_fsdp_needs(world_size: int) -> None:
    w = world_size
    results = harness.run(_collectives, world_size=w, mode="thread")
    total = w * (w + 1) / 2
    for r, out in enumerate(results):
        assert out["SUM"] == [total] and out["AVG"] == [total / w]
        assert out["MAX"] == [float(w)] and out["MIN"] == [1.0]
        assert out["all_gather_single"] == [float(i) for i in range(w) for _ in range(2)]
        assert out["all_gather"] == [float(i) for i in range(w)]
        assert out["reduce_scatter_single"] == [float(r * w)]
        assert out["reduce_scatter"] == [float(r * w)]
        assert out["broadcast"] == [float(w - 1)]
        assert out["async_completed"] == [1.0]


def _mesh_groups(ctx: harness.RankContext) -> tuple[list[int], list[int]]:
    mesh = ctx.device_mesh((2, 2), ("replicate", "shard"))
    return (dist.get_process_group_ranks(mesh.get_group("replicate")),
            dist.get_process_group_ranks(mesh.get_group("shard")))


def test_two_dimensional_device_mesh() -> None:
    assert harness.run(_mesh_groups, world_size=4, mode="thread") == [
        ([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])
    ]


def _default_devices(ctx: harness.RankContext) -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor

    sub = ctx.new_group([0, 1])
    devices = [d.type for g in (dist.group.WORLD, sub) for d in g._device_types]  # type: ignore[union-attr]
    chunk = _create_chunk_sharded_tensor(torch.arange(4.0), ctx.rank, ctx.world_size, 1, sub)
    devices.append(chunk.local_shards()[0].tensor.device.type)
    model = FullyShardedDataParallel(nn.Linear(2, 2), device_id=torch.device("cpu"))
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        devices.append(model.state_dict()["weight"].local_shards()[0].tensor.device.type)
    return devices


def test_groups_report_cpu_as_their_device() -> None:
    """FSDP1's sharded state dict asks the group for its default device."""
    from torch.testing._internal.distributed import multi_threaded_pg

    assert harness.run(_default_devices, world_size=2, mode="thread") == [["cpu"] * 4] * 2
    assert "_device_types" not in vars(multi_threaded_pg.ProcessLocalGroup), "uninstall left the property"


def _train(ctx: harness.RankContext, flavour: str) -> list[float]:
    with ctx.rng(0):  # identical init on every rank, also when ranks are threads
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if flavour == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    else:
        from torch.distributed.fsdp import fully_shard

        shape = (2, 2) if flavour == "hsdp" else (ctx.world_size,)
        names = ("replicate", "shard") if flavour == "hsdp" else ("shard",)
        mesh = ctx.device_mesh(shape, names)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.full((4, 8), 0.1 * (ctx.rank + 1))
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("flavour", "world_size"), [("fsdp1", 2), ("fsdp1", 4), ("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4)]
)
def test_torch_fsdp_trains_on_thread_ranks(flavour: str, world_size: int) -> None:
    thread = harness.run(_train, world_size=world_size, mode="thread", args=(flavour,))
    assert all(run[-1] < run[0] for run in thread), f"loss did not decrease: {thread}"
    if world_size == 2:
        process = harness.run(_train, world_size=world_size, mode="process", args=(flavour,))
        torch.testing.assert_close(torch.tensor(thread), torch.tensor(process))


def _blocked_then_aborted(ctx: harness.RankContext) -> None:
    if ctx.rank == 0:
        raise KeyError("first")
    dist.all_reduce(torch.ones(1))


def test_abort_wakes_ranks_blocked_in_a_collective() -> None:
    with pytest.raises(harness.RankRaised) as info:
        harness.run(_blocked_then_aborted, world_size=3, mode="thread", timeout_s=20)
    assert [(f.rank, f.kind) for f in info.value.failures] == [(0, "raised"), (1, "aborted"), (2, "aborted")]
