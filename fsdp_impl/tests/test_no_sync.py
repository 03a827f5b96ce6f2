"""``no_sync()``: where it may be entered, that backwards inside it communicate nothing, and that the
first backward after it reduces every micro-batch's gradient ([Note: no_sync] in ``fsdp_impl/unit.py``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import FSDP, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_impl.no_sync import INNER_UNIT_MESSAGE, no_sync
from fsdp_impl.tests.models import Block, OddModel, batch, prefixed
from fsdp_impl.unit_state import unit_state
from fsdp_impl.wrap import ModuleWrapPolicy
from harness.ranks.context import RankContext

S = ShardingStrategy
MICRO = 3  # backwards per accumulation: all but the last inside no_sync
GRAD_COLLECTIVES = ("reduce_scatter_tensor", "reduce_scatter", "all_reduce")


def _wrap(model: nn.Module, strategy: ShardingStrategy, pg: Any = None, **kw: Any) -> FSDP:
    return FSDP(model, process_group=pg, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)


def _errors_body(rank: int) -> None:
    fsdp = _wrap(OddModel(seed=0), S.FULL_SHARD)
    fsdp(batch(0, rank)).sum().backward()
    inner = FSDP.fsdp_modules(fsdp)[1]
    with pytest.raises(RuntimeError, match=f"^{re.escape(INNER_UNIT_MESSAGE)}$"), inner.no_sync():
        pass
    with pytest.raises(TypeError, match="no_sync\\(\\) needs an FSDP unit, got Linear"), no_sync(nn.Linear(2, 2)):
        pass
    caught: list[str] = []

    def enter(*_: object) -> None:
        try:
            with fsdp.no_sync():
                pass
        except ValueError as exc:
            caught.append(str(exc))

    handle = fsdp.module.b2.register_forward_pre_hook(enter)
    out = fsdp(batch(1, rank))
    handle.remove()
    out.register_hook(lambda grad: enter())
    out.sum().backward()
    plain = torch.ones(1, requires_grad=True)  # a backward that never reaches the root: it stays IDLE
    plain.register_hook(lambda grad: enter())
    (plain * 2).sum().backward()
    expected = "no_sync() must be entered between iterations: expected to be in states [<TrainingState.IDLE: 1>] " \
        "but current state is TrainingState."
    assert caught == [f"{expected}FORWARD", f"{expected}BACKWARD_PRE (inside a backward)",
                      f"{expected}IDLE (inside a backward)"], caught
    units = unit_state(fsdp).root.units  # type: ignore[union-attr]
    with fsdp.no_sync():
        with fsdp.no_sync():
            pass
        assert not any(u.controls.requires_gradient_sync for u in units), "leaving a nested no_sync() re-enabled sync"
    assert all(u.controls.requires_gradient_sync for u in units), "leaving no_sync() did not re-enable gradient sync"


@pytest.mark.ranks(world_size=2, modes=("thread",))
def test_no_sync_errors_and_nesting(ctx: RankContext) -> None:
    _errors_body(ctx.rank)


def _sharded_grads(fsdp: FSDP) -> list[torch.Tensor | None]:
    return [None if u.flat_param is None or u.flat_param.grad is None else u.flat_param.grad.clone()
            for u in FSDP.fsdp_modules(fsdp)]


def _check_kept(ctx: RankContext, fsdp: FSDP, label: str, param_dtype: torch.dtype) -> None:
    """After a backward inside no_sync: each unit kept an unsharded gradient where torch keeps it."""
    for unit in FSDP.fsdp_modules(fsdp):
        state = unit_state(unit)
        assert state is not None and state.handle is not None
        kept = state.unsynced_grad
        assert kept is not None, f"{label}: {state.fqn_prefix or 'root'} kept no gradient"
        assert kept.numel() == state.handle.padded_numel, f"{label}: kept {kept.numel()} elements, not unsharded"
        assert (kept.device, kept.dtype) == (state.compute_device, param_dtype), f"{label}: kept on {kept.device} " \
            f"in {kept.dtype}, expected the compute device {state.compute_device} in {param_dtype}"
        assert unit.is_resharded, f"{label}: not resharded after a backward inside no_sync"


def _accumulate(ctx: RankContext, synced: FSDP, unsynced: FSDP, label: str, param_dtype: torch.dtype) -> None:
    """``MICRO`` backwards on both models; on ``unsynced`` all but the last inside ``no_sync``."""
    for micro in range(MICRO):
        x = batch(micro, ctx.rank)
        synced(x).sum().backward()
        if micro == MICRO - 1:
            unsynced(x).sum().backward()
            continue
        before = _sharded_grads(unsynced)
        with ctx.record_collectives() as trace, unsynced.no_sync():
            unsynced(x).sum().backward()
        reductions = [c for c in trace.calls if c.op in GRAD_COLLECTIVES]
        assert not reductions, f"{label}: backward inside no_sync communicated:\n{trace.render()}"
        _check_kept(ctx, unsynced, f"{label} micro {micro}", param_dtype)
        after = _sharded_grads(unsynced)
        assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in zip(before, after, strict=True)), f"{label}: no_sync changed the exposed grads"


def _parity_body(ctx: RankContext, configs: list[tuple[ShardingStrategy, dict[str, Any]]], pg: Any) -> None:
    for strategy, kw in configs:
        mp = kw.get("mixed_precision")
        param_dtype = torch.float32 if mp is None else mp.param_dtype
        synced = _wrap(OddModel(seed=0), strategy, pg, **kw)
        unsynced = _wrap(OddModel(seed=0), strategy, pg, **kw)
        for cycle in range(2):
            label = f"{strategy.name} {kw} cycle {cycle} rank {ctx.rank}"
            _accumulate(ctx, synced, unsynced, label, param_dtype)
            assert all(unit_state(u).unsynced_grad is None for u in FSDP.fsdp_modules(unsynced)), (  # type: ignore[union-attr]
                f"{label}: the kept gradient outlived the synchronizing backward"
            )
            for index, (got, want) in enumerate(zip(_sharded_grads(unsynced), _sharded_grads(synced), strict=True)):
                assert got is not None and want is not None, f"{label}: unit {index} has no grad"
                # Under mixed precision the kept gradient adds up in bfloat16 (param_dtype, as torch
                # keeps it), the synced model's in float32 after each reduction: they differ by the
                # rounding of MICRO bfloat16 additions (unit roundoff 2**-8) at the gradients' scale.
                tol = {} if mp is None else {"rtol": 1.6e-2, "atol": MICRO * 2**-8 * float(want.abs().max())}
                torch.testing.assert_close(got, want, msg=prefixed(f"{label}: unit {index} grad"), **tol)
            for model in (synced, unsynced):
                for p in model.parameters():
                    p.grad = None
                for u in FSDP.fsdp_modules(model):
                    if u.flat_param is not None:
                        u.flat_param.grad = None


@pytest.mark.ranks(world_size=2, modes=("thread",))
def test_no_sync_communicates_nothing_then_reduces_everything(ctx: RankContext) -> None:
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    configs = [
        (S.FULL_SHARD, {}),
        (S.SHARD_GRAD_OP, {"use_orig_params": True}),
        (S.NO_SHARD, {}),
        (S.FULL_SHARD, {"use_orig_params": True, "cpu_offload": CPUOffload(offload_params=True)}),
        (S.FULL_SHARD, {"mixed_precision": bf16}),
    ]
    _parity_body(ctx, configs, None)


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_no_sync_hybrid(ctx: RankContext) -> None:
    half = ctx.world_size // 2
    shards = [dist.new_group(list(range(i, i + half))) for i in range(0, ctx.world_size, half)]
    reps = [dist.new_group(list(range(i, ctx.world_size, half))) for i in range(half)]
    pg = (shards[ctx.rank // half], reps[ctx.rank % half])
    _parity_body(ctx, [(S.HYBRID_SHARD, {"use_orig_params": True}), (S._HYBRID_SHARD_ZERO2, {})], pg)

