"""Training parity with DDP and per-step collective traces, per strategy, on process ranks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_impl import FSDP, BackwardPrefetch, CPUOffload, ShardingStrategy
from fsdp_impl.tests.models import Block, OddModel, batch, prefixed
from fsdp_impl.wrap import ModuleWrapPolicy
from harness.ranks.context import RankContext

S = ShardingStrategy


def _hybrid_groups(rank: int, world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    half = world // 2
    shards = [dist.new_group(list(range(i, i + half))) for i in range(0, world, half)]
    reps = [dist.new_group(list(range(i, world, half))) for i in range(half)]
    return shards[rank // half], reps[rank % half]


def _wrap(
    model: torch.nn.Module, strategy: ShardingStrategy, orig: bool, rank: int, world: int, **kw: Any
) -> FSDP:
    pg = (
        _hybrid_groups(rank, world)
        if strategy.name.startswith("_HYBRID") or strategy is S.HYBRID_SHARD
        else None
    )
    return FSDP(
        model,
        process_group=pg,
        sharding_strategy=strategy,
        use_orig_params=orig,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **kw,
    )


def _full_grads(model: FSDP) -> dict[str, torch.Tensor | None]:
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        return {
            n.replace("_fsdp_wrapped_module.", ""): None if p.grad is None else p.grad.clone()
            for n, p in model.named_parameters()
        }


def _full_params(model: FSDP) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model, writeback=False):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }


def _parity_body(rank: int, world: int, strategies: list[str], kw: dict[str, Any]) -> None:
    for name in strategies:
        for orig in (False, True):
            model = OddModel(seed=0)
            ddp = DDP(copy.deepcopy(model))
            fsdp = _wrap(model, S[name], orig, rank, world, **kw)
            opt_f = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
            opt_d = torch.optim.Adam(ddp.parameters(), lr=1e-2)
            for step in range(10):
                x = batch(step, rank)
                loss_f, loss_d = fsdp(x).sum(), ddp(x).sum()
                loss_f.backward()
                loss_d.backward()
                label = f"{name} orig={orig} step={step} rank={rank}"
                torch.testing.assert_close(loss_f, loss_d, msg=prefixed(f"{label}: loss"))
                assert all(u.is_resharded for u in FSDP.fsdp_modules(fsdp)), (
                    f"{label}: not resharded"
                )
                want = {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}
                torch.testing.assert_close(_full_grads(fsdp), want, msg=prefixed(f"{label}: grads"))
                opt_f.step(), opt_d.step()
                opt_f.zero_grad(), opt_d.zero_grad()
            want = {n.removeprefix("module."): p for n, p in ddp.named_parameters()}
            torch.testing.assert_close(
                _full_params(fsdp), want, msg=prefixed(f"{name} orig={orig}: params")
            )


@pytest.mark.ranks(world_size=2)
def test_parity_with_ddp_ws2(ctx: RankContext) -> None:
    _parity_body(ctx.rank, ctx.world_size, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], {})


@pytest.mark.ranks(world_size=2, modes=("thread",))
def test_parity_with_ddp_ws2_prefetch(ctx: RankContext) -> None:
    kw = {"forward_prefetch": True, "backward_prefetch": BackwardPrefetch.BACKWARD_POST}
    _parity_body(ctx.rank, ctx.world_size, ["FULL_SHARD", "SHARD_GRAD_OP"], kw)


@pytest.mark.ranks(world_size=2, modes=("thread",))
def test_parity_with_ddp_ws2_cpu_offload(ctx: RankContext) -> None:
    kw = {"cpu_offload": CPUOffload(offload_params=True), "device_id": torch.device("cpu")}
    _parity_body(ctx.rank, ctx.world_size, ["FULL_SHARD", "NO_SHARD"], kw)


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_parity_with_ddp_ws4(ctx: RankContext) -> None:
    _parity_body(ctx.rank, ctx.world_size, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], {})


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_parity_with_ddp_hybrid_ws4(ctx: RankContext) -> None:
    _parity_body(ctx.rank, ctx.world_size, ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"], {})


@pytest.mark.ranks(world_size=1, modes=("thread",))
def test_parity_ws1(ctx: RankContext) -> None:
    with ctx.catch_warnings() as caught:
        _parity_body(0, 1, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], {})
    switched = [w for w in caught if "switching to use `NO_SHARD`" in str(w.message)]
    # One warning per wrap (nested units inherit the switched strategy): 2 strategies x 2 modes.
    assert len(switched) == 2 * 2, [str(w.message) for w in caught]


# -- collective traces --------------------------------------------------------------------------
AG, RS, AR = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"


def _expected(model: FSDP, strategy: ShardingStrategy, world: int) -> list[tuple[str, int, int]]:
    """(op, group size, bytes) per step: AG input = local shard, RS input = padded flat grad."""
    units = FSDP.fsdp_modules(model)
    info = [u.shard_info for u in units]
    hybrid = strategy in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2)
    shard = world // 2 if hybrid else world
    if strategy is S.NO_SHARD:
        return [(AR, world, i["numel"] * 4) for i in info]
    # Forward gathers every unit; backward re-gathers non-root units that freed after forward.
    regather = info[1:] if strategy in (S.FULL_SHARD, S.HYBRID_SHARD) else []
    out = [(AG, shard, i["shard_numel"] * 4) for i in info + regather]
    out += [(RS, shard, i["padded_numel"] * 4) for i in info]
    if hybrid:
        out += [(AR, world // shard, i["shard_numel"] * 4) for i in info]
    return out


def _trace_body(ctx: RankContext, strategies: list[str]) -> None:
    for name in strategies:
        strategy = S[name]
        fsdp = _wrap(OddModel(seed=0), strategy, False, ctx.rank, ctx.world_size)
        for step in range(2):
            with ctx.record_collectives() as trace:
                fsdp(batch(step, ctx.rank)).sum().backward()
            got = sorted((c.op, len(c.group_ranks), c.bytes) for c in trace.calls)
            want = sorted(_expected(fsdp, strategy, ctx.world_size))
            assert got == want, f"{name} step {step}:\n{trace.render()}\nexpected {want}"
            assert all(c.async_op for c in trace.calls), trace.render()


@pytest.mark.ranks(world_size=2)
def test_collective_trace_ws2(ctx: RankContext) -> None:
    _trace_body(ctx, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_collective_trace_hybrid_ws4(ctx: RankContext) -> None:
    _trace_body(ctx, ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
