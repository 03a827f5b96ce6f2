"""Training parity with DDP and per-step collective traces, per strategy, on process ranks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_impl import FSDP, ShardingStrategy
from fsdp_impl.tests.models import Block, OddModel, batch
from fsdp_impl.wrap import ModuleWrapPolicy

S = ShardingStrategy


def _hybrid_groups(rank: int, world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    half = world // 2
    shards = [dist.new_group(list(range(i, i + half))) for i in range(0, world, half)]
    reps = [dist.new_group(list(range(i, world, half))) for i in range(half)]
    return shards[rank // half], reps[rank % half]


def _wrap(model: torch.nn.Module, strategy: ShardingStrategy, orig: bool, rank: int, world: int, **kw: Any) -> FSDP:
    pg = _hybrid_groups(rank, world) if strategy.name.startswith("_HYBRID") or strategy is S.HYBRID_SHARD else None
    return FSDP(model, process_group=pg, sharding_strategy=strategy, use_orig_params=orig,
                auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)


def _full_grads(model: FSDP) -> dict[str, torch.Tensor | None]:
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        return {n.replace("_fsdp_wrapped_module.", ""): None if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters()}


def _full_params(model: FSDP) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}


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
                torch.testing.assert_close(loss_f, loss_d, msg=lambda m: f"{label}: loss {m}")
                assert all(u.is_resharded for u in FSDP.fsdp_modules(fsdp)), f"{label}: not resharded"
                want = {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}
                torch.testing.assert_close(_full_grads(fsdp), want, msg=lambda m: f"{label}: grads {m}")
                opt_f.step(), opt_d.step()
                opt_f.zero_grad(), opt_d.zero_grad()
            want = {n.removeprefix("module."): p for n, p in ddp.named_parameters()}
            torch.testing.assert_close(_full_params(fsdp), want, msg=lambda m: f"{name} orig={orig}: params {m}")


@pytest.mark.parametrize("world", [2])
def test_parity_with_ddp_ws2(spawn_ranks: Callable[..., None], world: int) -> None:
    spawn_ranks(_parity_body, world, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], {})


def test_parity_with_ddp_ws2_prefetch(spawn_ranks: Callable[..., None]) -> None:
    kw = {"forward_prefetch": True, "backward_prefetch": None}
    spawn_ranks(_parity_body, 2, ["FULL_SHARD", "SHARD_GRAD_OP"], kw)


def test_parity_with_ddp_hybrid_ws4(spawn_ranks: Callable[..., None]) -> None:
    spawn_ranks(_parity_body, 4, ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"], {})


def test_parity_ws1(ws1: None) -> None:
    with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
        _parity_body(0, 1, ["FULL_SHARD"], {})


# -- collective traces --------------------------------------------------------------------------
_TRACED = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def _record(log: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Patch the collectives fsdp_impl calls (looked up at call time) to log (op, group size, bytes)."""
    originals = {name: getattr(dist, name) for name in _TRACED}

    def make(name: str) -> Any:
        def traced(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            big = args[0] if name != "reduce_scatter_single" else args[1]
            log.append((name, dist.get_world_size(group), big.numel() * big.element_size()))
            return originals[name](*args, group=group, **kwargs)
        return traced

    for name in _TRACED:
        setattr(dist, name, make(name))
    return originals


def _expected(model: FSDP, strategy: ShardingStrategy, world: int) -> list[tuple[str, int, int]]:
    units = FSDP.fsdp_modules(model)
    info = [u.shard_info for u in units]
    hybrid = strategy in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2)
    shard = world // 2 if hybrid else world
    out: list[tuple[str, int, int]] = []
    if strategy is S.NO_SHARD:
        return [("all_reduce", world, i["numel"] * 4) for i in info]
    gathers = len(units) + (len(units) - 1 if strategy in (S.FULL_SHARD, S.HYBRID_SHARD) else 0)
    out += [("all_gather_single", shard, 0)] * gathers
    out += [("reduce_scatter_single", shard, i["padded_numel"] * 4) for i in info]
    if hybrid:
        out += [("all_reduce", world // shard, i["shard_numel"] * 4) for i in info]
    return out


def _trace_body(rank: int, world: int, strategies: list[str]) -> None:
    for name in strategies:
        strategy = S[name]
        fsdp = _wrap(OddModel(seed=0), strategy, False, rank, world)
        for step in range(2):
            log: list[tuple[str, int, int]] = []
            originals = _record(log)
            try:
                fsdp(batch(step, rank)).sum().backward()
            finally:
                for key, fn in originals.items():
                    setattr(dist, key, fn)
            want = _expected(fsdp, strategy, world)
            gathers = sorted(b for op, _, b in log if op == "all_gather_single")
            got = sorted((op, g, 0 if op == "all_gather_single" else b) for op, g, b in log)
            assert got == sorted(want), f"{name} step {step}: {got} != {sorted(want)}"
            padded = sorted(u.shard_info["padded_numel"] * 4 for u in FSDP.fsdp_modules(fsdp))
            assert set(gathers) <= set(padded), f"{name}: all-gather bytes {gathers} not in {padded}"


def test_collective_trace_ws2(spawn_ranks: Callable[..., None]) -> None:
    spawn_ranks(_trace_body, 2, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])


def test_collective_trace_hybrid_ws4(spawn_ranks: Callable[..., None]) -> None:
    spawn_ranks(_trace_body, 4, ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
