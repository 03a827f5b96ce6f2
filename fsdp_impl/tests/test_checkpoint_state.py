"""Activation checkpointing around/inside units, and state-dict / optimizer-state round trips."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.utils.checkpoint import checkpoint

from fixtures.checkpointing import FFN, CheckpointTower, ffn_layers
from fsdp_impl import FSDP, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType
from fsdp_impl.tests.models import Block, OddModel, batch, prefixed
from fsdp_impl.wrap import ModuleWrapPolicy
from harness.ranks.context import RankContext

S = ShardingStrategy


def _variants(kw: dict[str, Any]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Same layers, differently checkpointed; each maps an input to an output."""

    def unit(module: nn.Module) -> FSDP:
        return FSDP(module, **kw)

    plain = FSDP(FFN(ffn_layers(), unit), **kw)
    outside = FSDP(FFN(ffn_layers(), lambda m: checkpoint_wrapper(unit(m))), **kw)
    inside = FSDP(FFN(ffn_layers(), lambda m: unit(checkpoint_wrapper(m))), **kw)
    reentrant_inside = FSDP(
        FFN(
            ffn_layers(),
            lambda m: unit(checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.REENTRANT)),
        ),
        **kw,
    )
    offload = FSDP(FFN(ffn_layers(), lambda m: unit(offload_wrapper(m))), **kw)
    around = FSDP(FFN(ffn_layers(), unit), **kw)
    around2 = FSDP(FFN(ffn_layers(), unit), **kw)
    return {
        "plain": plain,
        "outside": outside,
        "inside": inside,
        "reentrant_inside": reentrant_inside,
        "offload": offload,
        "reentrant_on_root": lambda x: checkpoint(around, x, use_reentrant=True),
        "nonreentrant_on_root": lambda x: checkpoint(around2, x, use_reentrant=False),
        "_models": [plain, outside, inside, reentrant_inside, offload, around, around2],  # type: ignore[dict-item]
    }


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        return [p.grad.clone() for p in model.parameters()]


@pytest.mark.ranks(world_size=2, modes=("thread",))
@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("offload_params", [False, True])
def test_checkpointing_matches_plain(ctx: RankContext, orig: bool, offload_params: bool) -> None:
    kw = {"use_orig_params": orig, "cpu_offload": CPUOffload(offload_params)}
    variants = _variants(kw)
    models = variants.pop("_models")
    for step in range(2):
        x = torch.randn(
            4, 3, generator=torch.Generator().manual_seed(step + 10 * ctx.rank), requires_grad=True
        )
        results = {}
        for name, fn in variants.items():
            out = fn(x)
            out.sum().backward()
            results[name] = out.detach()
        for model in models:  # type: ignore[union-attr]
            assert all(u.is_resharded for u in FSDP.fsdp_modules(model))
        grads = [_full_grads(m) for m in models]  # type: ignore[union-attr]
        for name, out in results.items():
            torch.testing.assert_close(out, results["plain"], msg=prefixed(f"{name} step {step}"))
        for index, got in enumerate(grads[1:], start=1):
            torch.testing.assert_close(
                got, grads[0], msg=prefixed(f"model {index} grads step {step}")
            )
        for model in models:  # type: ignore[union-attr]
            model.zero_grad(set_to_none=True)


@pytest.mark.ranks(world_size=2, modes=("thread",))
@pytest.mark.parametrize("strategy", [S.NO_SHARD, S.FULL_SHARD])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_inside_part_of_a_unit(
    ctx: RankContext, strategy: ShardingStrategy, use_reentrant: bool
) -> None:
    """Checkpointed blocks cover only part of each unit (the stage's l1/l2 are outside)."""
    reference = CheckpointTower(seed=0, dim=8)
    model = copy.deepcopy(reference)
    model.enable_checkpointing()
    for m in (model.stage1.s1, model.stage1.s2, model.stage2.s1, model.stage2.s2):
        m.use_reentrant = use_reentrant
    model.stage1 = FSDP(model.stage1, sharding_strategy=strategy)
    model.stage2 = FSDP(model.stage2, sharding_strategy=strategy)
    fsdp = FSDP(model, sharding_strategy=strategy)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    fsdp(x).sum().backward()
    reference(x).sum().backward()
    assert all(u.is_resharded for u in FSDP.fsdp_modules(fsdp))
    want = {n: p.grad for n, p in reference.named_parameters()}
    with FSDP.summon_full_params(fsdp, with_grads=True):
        got = {
            n.replace("_fsdp_wrapped_module.", ""): p.grad.clone()
            for n, p in fsdp.named_parameters()
        }
    torch.testing.assert_close(got, want)


# -- state dicts -------------------------------------------------------------------------------
def _make(orig: bool, strategy: ShardingStrategy, seed: int) -> tuple[FSDP, torch.optim.Optimizer]:
    model = FSDP(
        OddModel(seed=seed),
        sharding_strategy=strategy,
        use_orig_params=orig,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(
    model: FSDP, optim: torch.optim.Optimizer, steps: range, rank: int
) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        loss = model(batch(step, rank)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def _roundtrip_body(ctx: RankContext, strategies: list[ShardingStrategy]) -> None:
    for strategy in strategies:
        for orig in (False, True):
            for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
                label = f"{strategy.name} orig={orig} {kind.name}"
                model, optim = _make(orig, strategy, seed=0)
                _train(model, optim, range(2), ctx.rank)
                with FSDP.state_dict_type(model, kind):
                    state = model.state_dict()
                    osd = FSDP.optim_state_dict(model, optim)
                if kind is StateDictType.FULL_STATE_DICT:
                    assert set(state) == set(OddModel().state_dict()), label
                    for name, value in osd["state"].items():
                        assert value["exp_avg"].shape == state[name].shape, (label, name)
                fresh, fresh_optim = _make(orig, strategy, seed=1)
                with FSDP.state_dict_type(fresh, kind):
                    fresh.load_state_dict(state)
                    fresh_optim.load_state_dict(
                        FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd)
                    )
                with FSDP.summon_full_params(model), FSDP.summon_full_params(fresh):
                    torch.testing.assert_close(
                        dict(fresh.named_parameters()),
                        dict(model.named_parameters()),
                        msg=prefixed(f"{label}: params"),
                    )
                expected = _train(model, optim, range(2, 5), ctx.rank)
                got = _train(fresh, fresh_optim, range(2, 5), ctx.rank)
                torch.testing.assert_close(
                    got, expected, msg=prefixed(f"{label}: losses after load")
                )


@pytest.mark.ranks(world_size=2)
def test_state_dict_roundtrip_ws2(ctx: RankContext) -> None:
    _roundtrip_body(ctx, [S.FULL_SHARD, S.NO_SHARD])


@pytest.mark.ranks(world_size=4, modes=("thread",), env={"LOCAL_WORLD_SIZE": "2"})
def test_state_dict_roundtrip_hybrid_ws4(ctx: RankContext) -> None:
    _roundtrip_body(ctx, [S.HYBRID_SHARD])


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.tensor([0.1234567, 1.0009765]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.ranks(world_size=2, modes=("thread",))
@pytest.mark.parametrize("kind", [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT])
def test_state_dict_holds_buffers_in_their_own_dtype(ctx: RankContext, kind: StateDictType) -> None:
    """With a buffer_dtype, buffers compute in it (their values rounded from the first forward on,
    as FSDP1 documents) but a state dict holds them in the dtype they were built in."""
    model = FSDP(_Scaled(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    model(torch.ones(1, 2))
    with FSDP.state_dict_type(model, kind):
        saved = model.state_dict()["scale"]
    rounded = torch.tensor([0.1234567, 1.0009765]).to(torch.bfloat16).float()
    assert saved.dtype == torch.float32, saved.dtype
    torch.testing.assert_close(saved, rounded, rtol=0, atol=0)
