"""Multi-rank runtime behaviour: exec-order checks, sync_module_states, hybrid groups,
unused outputs, and how many units are unsharded at once."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fixtures.models import ExecOrderModel, TwoOutputModel
from fsdp_impl import FSDP, BackwardPrefetch, ShardingStrategy
from fsdp_impl.tests.models import Block, OddModel, batch
from fsdp_impl.wrap import ModuleWrapPolicy, always_wrap_policy
from harness.ranks.context import RankContext

S = ShardingStrategy


def _exec_order_model(strategy: ShardingStrategy) -> tuple[ExecOrderModel, FSDP]:
    model = ExecOrderModel(seed=0)
    model.layer1 = FSDP(model.layer1, sharding_strategy=strategy)
    model.layer2 = FSDP(model.layer2, sharding_strategy=strategy)
    return model, FSDP(model, sharding_strategy=strategy)


def _step(fsdp: FSDP, gen: torch.Generator) -> None:
    (x,) = ExecOrderModel.get_input(torch.device("cpu"), gen)
    fsdp(x).sum().backward()


def _exec_order_body(rank: int, world: int) -> None:
    for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP):
        model, fsdp = _exec_order_model(strategy)
        if rank != 0:
            model.flip_path()
        with pytest.raises(RuntimeError, match=r"^Forward order differs across ranks"):
            _step(fsdp, torch.Generator().manual_seed(rank))
    for iters_before in (1, 3):
        model, fsdp = _exec_order_model(S.FULL_SHARD)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(iters_before):
            _step(fsdp, gen)
        if rank != 0:
            model.flip_path()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                _step(fsdp, gen)
        msgs = [str(w.message) for w in caught if "Forward order differs" in str(w.message)]
        prefix = (
            f"Forward order differs from that of the first iteration on rank {rank}. "
            "Collectives are unchecked and may give incorrect results or hang"
        )
        assert len(msgs) == (1 if rank != 0 else 0), msgs
        assert all(m.startswith(prefix) for m in msgs), msgs
    model, fsdp = _exec_order_model(S.FULL_SHARD)
    gen = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            fsdp.train()
            for _ in range(3):
                _step(fsdp, gen)
            fsdp.eval()
            with torch.no_grad():
                for _ in range(3):
                    fsdp(ExecOrderModel.get_input(torch.device("cpu"), gen)[0])
    assert not [w for w in caught if "Forward order differs" in str(w.message)]


@pytest.mark.ranks(
    world_size=2, modes=("process",), env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, isolated=True
)
def test_exec_order_validation(ctx: RankContext) -> None:
    dist.set_debug_level_from_env()  # torch reads TORCH_DISTRIBUTED_DEBUG at import
    _exec_order_body(ctx.rank, ctx.world_size)


def _misc_body(rank: int, world: int) -> None:
    # sync_module_states: rank-dependent params and buffer become rank 0's.
    for device_id in (None, torch.device("cpu")):
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(rank)
            model[1].running_mean.fill_(rank)
        fsdp = FSDP(model, sync_module_states=True, device_id=device_id, use_orig_params=True)
        assert torch.equal(model[1].running_mean, torch.zeros(3))
        with FSDP.summon_full_params(fsdp):
            assert all(torch.equal(p, torch.zeros_like(p)) for p in fsdp.parameters())
    # Outputs not all used in the loss: every unit resharded, params track a local model.
    for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD):
        local = TwoOutputModel(seed=0)
        fsdp = FSDP(
            copy.deepcopy(local), sharding_strategy=strategy, auto_wrap_policy=always_wrap_policy
        )
        opt_f = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        opt_l = torch.optim.SGD(local.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            a, b = fsdp(x)
            la, lb = local(x)
            (a.sum() + b.sum() if step < 2 else a.sum()).backward()
            (la.sum() + lb.sum() if step < 2 else la.sum()).backward()
            assert all(u.is_resharded for u in FSDP.fsdp_modules(fsdp)), (strategy, step)
            opt_f.step(), opt_l.step()
            opt_f.zero_grad(), opt_l.zero_grad()
            with FSDP.summon_full_params(fsdp):
                got = {
                    n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in fsdp.named_parameters()
                }
            torch.testing.assert_close(got, dict(local.named_parameters()))
    # A (shard, replicate) tuple whose sizes do not multiply to the world.
    with pytest.raises(ValueError, match=r"shard\(2\) \* replicate\(2\) != world_size\(2\)"):
        FSDP(
            nn.Linear(2, 2),
            process_group=(dist.group.WORLD, dist.group.WORLD),
            sharding_strategy=S.HYBRID_SHARD,
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match=r"2-D \(replicate, shard\) device_mesh, got ndim=1"):
        FSDP(nn.Linear(2, 2), device_mesh=mesh, sharding_strategy=S.HYBRID_SHARD)
    assert FSDP(nn.Linear(2, 2), device_mesh=mesh).shard_info["shard_size"] == 2
    _peak_unsharded(rank)


def _peak_unsharded(rank: int) -> None:
    """Unsharded at once: the root, the computing unit, and (with prefetch) the one prefetched."""
    configs = (
        (False, None, 2),
        (True, BackwardPrefetch.BACKWARD_PRE, 3),
        (False, BackwardPrefetch.BACKWARD_POST, 2),
    )
    for forward_prefetch, backward_prefetch, bound in configs:
        fsdp = FSDP(
            OddModel(seed=0),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
        )
        units = FSDP.fsdp_modules(fsdp)
        seen: list[int] = []

        def count(*_: object, seen: list[int] = seen, units: list[FSDP] = units) -> None:
            seen.append(sum(not u.is_resharded for u in units))

        for module in fsdp.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(count)
                module.register_full_backward_pre_hook(count)
        for step in range(3):
            fsdp(batch(step, rank).requires_grad_()).sum().backward()
        assert seen and max(seen) <= bound, (forward_prefetch, backward_prefetch, seen)
        if bound == 3:
            assert max(seen) == bound, f"prefetch never overlapped: {seen}"
        assert min(seen) >= 1


@pytest.mark.ranks(world_size=2)
def test_misc_runtime_ws2(ctx: RankContext) -> None:
    _misc_body(ctx.rank, ctx.world_size)


def _hybrid_setup_body(rank: int, world: int) -> None:
    for use_mesh in (False, True):
        kwargs = {}
        if use_mesh:
            from torch.distributed.device_mesh import init_device_mesh

            kwargs["device_mesh"] = init_device_mesh(
                "cpu", (2, 2), mesh_dim_names=("replicate", "shard")
            )
        fsdp = FSDP(
            OddModel(seed=0),
            sharding_strategy=S.HYBRID_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            **kwargs,
        )
        units = FSDP.fsdp_modules(fsdp)
        shard_ranks = dist.get_process_group_ranks(units[0].process_group)
        rep_ranks = dist.get_process_group_ranks(units[0]._inter_node_pg)
        assert shard_ranks == [rank // 2 * 2, rank // 2 * 2 + 1], shard_ranks
        assert rep_ranks == [rank % 2, rank % 2 + 2], rep_ranks
        assert all(u.process_group is units[0].process_group for u in units)
        assert all(u._inter_node_pg is units[0]._inter_node_pg for u in units)


@pytest.mark.ranks(world_size=4, modes=("thread",), env={"LOCAL_WORLD_SIZE": "2"})
def test_hybrid_auto_groups_and_mesh_ws4(ctx: RankContext) -> None:
    _hybrid_setup_body(ctx.rank, ctx.world_size)
