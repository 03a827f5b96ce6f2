"""The collective-name shim: the newer name when torch has it, the older one otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import harness
from harness.tests import compat


@pytest.mark.parametrize(("name", "older"), [("all_gather_single", "all_gather_into_tensor"),
                                             ("reduce_scatter_single", "reduce_scatter_tensor")])
def test_falls_back_when_torch_lacks_the_newer_name(name: str, older: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if hasattr(dist, name):
        assert compat.resolve_collective(name) is getattr(dist, name)
        monkeypatch.delattr(dist, name)
    assert compat.resolve_collective(name) is getattr(dist, older)


def test_unknown_name_is_named() -> None:
    with pytest.raises(ValueError, match="no compatibility entry for 'all_gather_object'"):
        compat.resolve_collective("all_gather_object")


def _gather_and_scatter_without_newer_names(ctx: harness.RankContext) -> tuple[list[float], list[float]]:
    if ctx.mode == "process" or ctx.rank == 0:  # thread ranks share the module
        for name in ("all_gather_single", "reduce_scatter_single"):  # as on a torch that predates them
            if hasattr(dist, name):
                delattr(dist, name)  # restored by the per-case reset
    ctx.barrier()
    full = torch.empty(ctx.world_size)
    compat.all_gather_single(full, torch.tensor([float(ctx.rank)]))
    shard = torch.empty(1)
    compat.reduce_scatter_single(shard, torch.arange(ctx.world_size, dtype=torch.float32))
    return full.tolist(), shard.tolist()


def test_the_older_names_work_on_ranks() -> None:
    results = harness.run(_gather_and_scatter_without_newer_names, world_size=2, mode="thread")
    assert results == [([0.0, 1.0], [0.0]), ([0.0, 1.0], [2.0])]
    assert harness.run(_names_present, world_size=1, mode="thread") == [_names_present(None)]


def _names_present(ctx: object) -> list[bool]:
    return [hasattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")]
