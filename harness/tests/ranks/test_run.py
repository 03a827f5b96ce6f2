"""harness.run: per-rank values, skips, bad input, pool reuse and replacement."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import harness
from harness.ranks import process

MODES = ["process", "thread"]


def _sum_of_ranks(ctx: harness.RankContext, scale: int = 1) -> tuple[int, int, float]:
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, t.item() * scale


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_per_rank_values_in_rank_order(mode: str, world_size: int) -> None:
    values = harness.run(_sum_of_ranks, world_size=world_size, mode=mode, kwargs={"scale": 2})
    total = 2.0 * world_size * (world_size + 1) / 2
    assert values == [(r, world_size, total) for r in range(world_size)]


def _context_fields(ctx: harness.RankContext) -> dict[str, object]:
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "mode": ctx.mode,
        "env_rank": os.environ.get("RANK"),
        "equal": ctx.all_ranks_equal("same"),
        "unequal": ctx.all_ranks_equal(ctx.rank),
        "gathered": ctx.all_gather_object(ctx.rank * 10),
        "sub": dist.get_process_group_ranks(ctx.new_group([0, 1])),
    }


@pytest.mark.parametrize("mode", MODES)
def test_context_helpers(mode: str) -> None:
    out = harness.run(_context_fields, world_size=2, mode=mode)
    for rank, fields in enumerate(out):
        assert fields["rank"] == fields["local_rank"] == rank
        assert fields["device"] == "cpu" and fields["mode"] == mode
        assert fields["equal"] is True and fields["unequal"] is False
        assert fields["gathered"] == [0, 10] and fields["sub"] == [0, 1]
    if mode == "process":
        assert [f["env_rank"] for f in out] == ["0", "1"]
        assert out[0]["backend"] == "gloo"


def _skip_on(ctx: harness.RankContext, ranks: tuple[int, ...]) -> None:
    if ctx.rank in ranks:
        pytest.skip(f"skipping on rank {ctx.rank}" if len(ranks) < ctx.world_size else "no accelerator")


@pytest.mark.parametrize("mode", MODES)
def test_skip_on_every_rank_is_a_skip(mode: str) -> None:
    with pytest.raises(pytest.skip.Exception, match="no accelerator"):
        harness.run(_skip_on, world_size=2, mode=mode, args=((0, 1),))


@pytest.mark.parametrize("mode", MODES)
def test_skip_on_some_ranks_is_an_error(mode: str) -> None:
    with pytest.raises(harness.InconsistentSkip, match=r"^rank 1 skipped: .*skipping on rank 1.*did not skip"):
        harness.run(_skip_on, world_size=2, mode=mode, args=((1,),))


def _pid(ctx: harness.RankContext) -> int:
    return os.getpid()


def _raise_on_rank_1(ctx: harness.RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("bad shard")
    dist.barrier()


def test_pool_is_reused_and_replaced_after_a_failure() -> None:
    first = harness.run(_pid, world_size=2)
    assert harness.run(_pid, world_size=2) == first, "the pool was not reused"
    with pytest.raises(harness.RankRaised):
        harness.run(_raise_on_rank_1, world_size=2)
    after = harness.run(_pid, world_size=2)
    assert set(after).isdisjoint(first), "a failed pool must be replaced"
    assert harness.run(_pid, world_size=2, isolated=True) != after


@pytest.mark.parametrize("mode", MODES)
def test_ranks_import_what_the_caller_can_after_sys_path_grows(mode: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool or thread host started before a directory went on ``sys.path`` is replaced, not reused: its
    ranks could not import a function from there ([Note: process pool lifecycle])."""
    harness.run(_pid, world_size=2, mode=mode)  # started under the path as it was
    (tmp_path / "harness_later_module.py").write_text("def rank_plus_one(ctx):\n    return ctx.rank + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "harness_later_module", raising=False)
    later = importlib.import_module("harness_later_module")
    try:
        assert harness.run(later.rank_plus_one, world_size=2, mode=mode) == [1, 2]
    finally:
        del sys.modules["harness_later_module"]


def _set_state(ctx: harness.RankContext) -> tuple[str | None, int, int, float]:
    if ctx.mode == "thread":
        # Thread ranks share the process's global RNG; ctx.rng serialises and seeds it.
        with ctx.rng(ctx.seed):
            draw = torch.rand(1).item()
    else:
        draw = torch.rand(1).item()  # each rank process is seeded with ctx.seed before the case
    seen = (os.environ.get("HARNESS_LEAK"), len(dist.distributed_c10d._world.pg_map),
            int(dist.get_debug_level()), draw)
    ctx.barrier()  # thread ranks share the environment: read everything before anyone writes
    os.environ["HARNESS_LEAK"] = "1"
    dist.new_group([0, 1])  # the case's own group (what the context keeps is [Note: kept groups]'s)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_per_case_state_is_reset(mode: str) -> None:
    first = harness.run(_set_state, world_size=2, mode=mode)
    second = harness.run(_set_state, world_size=2, mode=mode)
    assert first == second, "env, groups, debug level or seed leaked from one case into the next"
    assert first[0][0] is None and first[0][3] == first[1][3], "ranks must be seeded identically"


def _nested(ctx: harness.RankContext) -> None:
    harness.run(_pid, world_size=1, mode="thread")


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"world_size": 0}, ValueError, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2, "mode": "fork"}, ValueError, "mode must be one of"),
        ({"world_size": 2, "timeout_s": 0}, ValueError, "timeout_s must be > 0, got 0"),
        ({"world_size": 2, "placement": "mpi"}, ValueError, "placement must be one of"),
        # No machine has a GPU per rank for 1024 ranks, so this fails the same everywhere.
        ({"world_size": 1024, "placement": "cuda"}, RuntimeError, "placement 'cuda' needs one GPU per rank"),
    ],
)
def test_bad_input_is_rejected_before_anything_starts(kwargs: dict, error: type, pattern: str) -> None:
    before = process._pools.copy()
    with pytest.raises(error, match=pattern):
        harness.run(_pid, **kwargs)
    assert process._pools == before


@pytest.mark.parametrize("mode", MODES)
def test_both_modes_need_an_importable_function_and_picklable_args(mode: str) -> None:
    with pytest.raises(ValueError, match=f"{mode} mode needs an importable module-level function; .*lambda"):
        harness.run(lambda ctx: None, world_size=2, mode=mode)
    with pytest.raises(ValueError, match="does not pickle"):
        harness.run(_pid, world_size=2, mode=mode, args=(lambda: None,))


@pytest.mark.parametrize("mode", MODES)
def test_nested_runs_are_refused(mode: str) -> None:
    with pytest.raises(harness.RankRaised, match="nested runs are not supported"):
        harness.run(_nested, world_size=2, mode=mode)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _collection_after_freeze(ctx: harness.RankContext) -> tuple[int, bool]:
    """(objects left out of collections, whether a cycle made by the case is still collected)."""
    import gc
    import weakref

    cycle = _Cycle()
    watched = weakref.ref(cycle)
    del cycle
    gc.collect()
    return gc.get_freeze_count(), watched() is None


@pytest.mark.parametrize("mode", MODES)
def test_imports_are_frozen_and_a_cases_garbage_is_still_collected(mode: str) -> None:
    """[Note: frozen imports]: torch's imports are out of the collector's walk (over 100,000 objects frozen),
    and a reference cycle a case drops is freed by a collection as before."""
    for frozen, collected in harness.run(_collection_after_freeze, world_size=2, mode=mode):
        assert frozen > 100_000 and collected, (frozen, collected)
