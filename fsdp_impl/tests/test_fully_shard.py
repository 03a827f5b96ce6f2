"""``fully_shard`` (FSDP2's front door): training parity with a local model and with torch's own
``fully_shard`` run side by side, and the per-module controls counted in the collectives they issue."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_impl import FSDP, CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from fsdp_impl.tests.models import OddModel, batch, prefixed
from fsdp_impl.unit_state import unit_state
from harness.ranks.context import RankContext

AG, RS, AR = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"
ShardFn = Callable[..., nn.Module]
IMPLS: dict[str, ShardFn] = {"reference": fully_shard, "torch": torch_fully_shard}


def _mesh(ctx: RankContext, hybrid: bool = False) -> DeviceMesh:
    if hybrid:
        return init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (ctx.world_size,))


def _shard(model: OddModel, shard: ShardFn, mesh: DeviceMesh, **kw: Any) -> OddModel:
    """``shard`` bottom-up: every block, then the root (which keeps the head)."""
    for block in (model.b1, model.b2, model.b3):
        shard(block, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    return model


def _pair(ctx: RankContext, hybrid: bool = False, **kw: Any) -> tuple[OddModel, OddModel, OddModel]:
    """(local, reference, torch) models with equal parameters; the last two sharded alike."""
    local = OddModel(seed=0, b2_extra=1)
    mesh = _mesh(ctx, hybrid)
    torch_kw = {k: _as_torch(v) for k, v in kw.items()}
    return local, _shard(copy.deepcopy(local), fully_shard, mesh, **kw), _shard(
        copy.deepcopy(local), torch_fully_shard, mesh, **torch_kw
    )


def _as_torch(value: Any) -> Any:
    """The same policy spelled with torch's classes."""
    if isinstance(value, MixedPrecisionPolicy):
        return TorchMixedPrecisionPolicy(value.param_dtype, value.reduce_dtype, value.output_dtype,
                                         value.cast_forward_inputs)
    if isinstance(value, CPUOffloadPolicy):
        return TorchCPUOffloadPolicy(pin_memory=value.pin_memory)
    return value


def _batches(ctx: RankContext, step: int) -> list[torch.Tensor]:
    return [batch(step, rank) for rank in range(ctx.world_size)]


def _local_backward(local: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-rank losses of the local model; its gradient is their mean's (DDP's convention)."""
    losses = [local(x).sum() for x in xs]
    (sum(losses) / len(xs)).backward()
    return losses


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            assert isinstance(param, DTensor) and grad.placements == param.placements, name
            grad = grad.full_tensor()
        out[name] = grad
    return out


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


def _train_alike(ctx: RankContext, models: dict[str, nn.Module], steps: int = 3) -> None:
    """Adam steps on every model: losses, gradients and parameters must equal the first model's
    (``"local"`` when given: the unsharded model fed every rank's batch)."""
    first = next(iter(models))
    optims = {name: torch.optim.Adam(m.parameters(), lr=1e-2) for name, m in models.items()}
    for step in range(steps):
        xs = _batches(ctx, step)
        losses = {n: m(xs[ctx.rank]).sum() for n, m in models.items() if n != "local"}
        for loss in losses.values():
            loss.backward()
        if "local" in models:
            losses["local"] = _local_backward(models["local"], xs)[ctx.rank]
        grads = {name: _grads(model) for name, model in models.items()}
        for name in models:
            label = f"{name} vs {first} step {step} rank {ctx.rank}"
            torch.testing.assert_close(losses[name], losses[first], msg=prefixed(f"{label}: loss"))
            torch.testing.assert_close(grads[name], grads[first], msg=prefixed(f"{label}: grads"))
        for optim in optims.values():
            optim.step()
            optim.zero_grad()
    params = {name: _params(model) for name, model in models.items()}
    for name in models:
        torch.testing.assert_close(params[name], params[first], msg=prefixed(f"{name} vs {first}: params"))


def _parity_body(ctx: RankContext, hybrid: bool) -> None:
    local, ours, theirs = _pair(ctx, hybrid)
    placements = (Replicate(), Shard(0)) if hybrid else (Shard(0),)
    assert isinstance(ours, FSDPModule) and isinstance(ours, OddModel) and isinstance(ours.b2, FSDPModule)
    for name, param in ours.named_parameters():
        assert isinstance(param, DTensor) and param.placements == placements, (name, type(param))
        assert param.to_local().shape == theirs.get_parameter(name).to_local().shape, name
    state = ours.state_dict()
    assert list(state) == list(theirs.state_dict()) and all(isinstance(v, DTensor) for v in state.values())
    _train_alike(ctx, {"local": local, "reference": ours, "torch": theirs})


@pytest.mark.ranks(world_size=2)
def test_parity_1d_mesh(ctx: RankContext) -> None:
    _parity_body(ctx, hybrid=False)


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_parity_1d_and_2d_mesh_ws4(ctx: RankContext) -> None:
    _parity_body(ctx, hybrid=False)
    _parity_body(ctx, hybrid=True)


# -- reshard_after_forward: all-gathers per forward and backward --------------------------------
def _gathers(ctx: RankContext, model: nn.Module, step: int) -> tuple[list[int], list[int]]:
    """Group sizes of the all-gathers one forward and its backward issue."""
    with ctx.record_collectives() as forward:
        loss = model(batch(step, ctx.rank)).sum()
    with ctx.record_collectives() as backward:
        loss.backward()
    return [len(c.group_ranks) for c in forward.calls if c.op == AG], [
        len(c.group_ranks) for c in backward.calls if c.op == AG
    ]


def _reshard_after_forward_body(ctx: RankContext) -> None:
    ws = ctx.world_size
    # Four units (three blocks and the root); None keeps the root unsharded, an int regathers over 2.
    expected = {True: [ws] * 4, None: [ws] * 3, False: [], 2: [2] * 4}
    for setting, backward_groups in expected.items():
        for impl, shard in IMPLS.items():
            model = _shard(OddModel(seed=0, b2_extra=1), shard, _mesh(ctx), reshard_after_forward=setting)
            for step in range(2):
                label = f"{impl} reshard_after_forward={setting} step {step}"
                assert _gathers(ctx, model, step) == ([ws] * 4, backward_groups), label


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_reshard_after_forward_counts_gathers(ctx: RankContext) -> None:
    _reshard_after_forward_body(ctx)


def _reshard_int_parity_body(ctx: RankContext) -> None:
    local, ours, theirs = _pair(ctx, reshard_after_forward=2)
    _train_alike(ctx, {"local": local, "reference": ours, "torch": theirs})
    ours(batch(0, ctx.rank))
    assert not unit_state(ours.b1).handle.is_resharded, "no piece kept after forward"  # type: ignore[union-attr]
    ours.b1.reshard()
    assert unit_state(ours.b1).handle.is_resharded, "reshard() kept the post-forward piece"  # type: ignore[union-attr]


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_reshard_after_forward_int_trains_alike(ctx: RankContext) -> None:
    _reshard_int_parity_body(ctx)


def _set_reshard_after_forward_body(ctx: RankContext) -> None:
    ws = ctx.world_size
    for impl, shard in IMPLS.items():
        model = _shard(OddModel(seed=0, b2_extra=1), shard, _mesh(ctx))
        model.set_reshard_after_forward(False)
        assert _gathers(ctx, model, 0) == ([ws] * 4, []), impl
        model.set_reshard_after_forward(True, recurse=False)  # the root only
        assert _gathers(ctx, model, 1) == ([ws] * 4, [ws]), impl
        with pytest.raises(ValueError, match="reshard_after_forward should be a bool, got <class 'int'>"):
            model.set_reshard_after_forward(2)  # type: ignore[arg-type]


@pytest.mark.ranks(world_size=2)
def test_set_reshard_after_forward(ctx: RankContext) -> None:
    _set_reshard_after_forward_body(ctx)


# -- explicit prefetch: the order all-gathers are issued in -------------------------------------
def _unit_bytes(model: OddModel, world: int) -> dict[int, str]:
    """All-gather input bytes -> unit: every parameter padded to whole rows per rank."""
    units = {"root": model.head, "b1": model.b1, "b2": model.b2, "b3": model.b3}
    out = {}
    for name, module in units.items():
        shapes = [p.shape for p in module.parameters()]
        out[4 * sum(-(-s[0] // world) * s[1:].numel() for s in shapes)] = name
    assert len(out) == len(units), f"units not told apart by all-gather size: {out}"
    return out


def _order(trace: Any, names: dict[int, str]) -> list[str]:
    return [names[c.bytes] for c in trace.calls if c.op == AG]


def _prefetch_body(ctx: RankContext) -> None:
    for impl, shard in IMPLS.items():
        model = _shard(OddModel(seed=0, b2_extra=1), shard, _mesh(ctx), reshard_after_forward=True)
        names = _unit_bytes(model, ctx.world_size)
        for step, explicit in enumerate((False, True, True)):
            if explicit:
                model.b1.set_modules_to_forward_prefetch([model.b3, model.b2])
                model.set_modules_to_backward_prefetch([model.b2, model.b3])
            with ctx.record_collectives() as forward:
                loss = model(batch(step, ctx.rank)).sum()
            with ctx.record_collectives() as backward:
                loss.backward()
            want = (["root", "b1", "b3", "b2"], ["root", "b2", "b3", "b1"]) if explicit else (
                ["root", "b1", "b2", "b3"], ["root", "b3", "b2", "b1"])
            assert (_order(forward, names), _order(backward, names)) == want, f"{impl} step {step}"
    local, ours, theirs = _pair(ctx)
    for model in (ours, theirs):
        model.b1.set_modules_to_forward_prefetch([model.b3, model.b2])
        model.set_modules_to_backward_prefetch([model.b2, model.b3])
    _train_alike(ctx, {"local": local, "reference": ours, "torch": theirs})
    with pytest.raises(ValueError, match="Expects FSDPModule but got <class 'torch.nn.modules.linear.Linear'>"):
        ours.set_modules_to_forward_prefetch([ours.head])


@pytest.mark.ranks(world_size=2)
def test_explicit_prefetch_order(ctx: RankContext) -> None:
    _prefetch_body(ctx)


# -- gradient accumulation controls -------------------------------------------------------------
def _reductions(trace: Any) -> list[str]:
    return [c.op for c in trace.calls if c.op in (RS, AR)]


def _gradient_sync_body(ctx: RankContext, hybrid: bool, mp: MixedPrecisionPolicy | None) -> None:
    kw = {} if mp is None else {"mp_policy": mp}
    local, ours, theirs = _pair(ctx, hybrid, **kw)
    models = {"reference": ours, "torch": theirs}
    micro = 3
    for step in range(2):
        for index in range(micro):
            xs = _batches(ctx, step * micro + index)
            sync = index == micro - 1
            for model in models.values():
                model.set_requires_gradient_sync(sync)
            with ctx.record_collectives() as trace:
                for model in models.values():
                    model(xs[ctx.rank]).sum().backward()
            want = ([RS, AR] if hybrid else [RS]) * 8 if sync else []
            assert sorted(_reductions(trace)) == sorted(want), f"step {step} micro {index}:\n{trace.render()}"
            _local_backward(local, xs)
        grads = {"local": _grads(local)} | {name: _grads(model) for name, model in models.items()}
        label = f"hybrid={hybrid} mp={mp} step {step} rank {ctx.rank}"
        torch.testing.assert_close(grads["reference"], grads["torch"], msg=prefixed(f"{label}: vs torch"))
        if mp is None:
            torch.testing.assert_close(grads["reference"], grads["local"], msg=prefixed(f"{label}: vs local"))
        for model in (local, *models.values()):
            model.zero_grad()


@pytest.mark.ranks(world_size=2)
def test_requires_gradient_sync(ctx: RankContext) -> None:
    _gradient_sync_body(ctx, hybrid=False, mp=None)


@pytest.mark.ranks(world_size=4, modes=("thread",))
def test_requires_gradient_sync_hybrid_and_mixed_precision(ctx: RankContext) -> None:
    _gradient_sync_body(ctx, hybrid=True, mp=None)
    # Kept gradients add up in reduce_dtype (float32) as torch's do; in bfloat16 they would differ.
    _gradient_sync_body(ctx, hybrid=False, mp=MixedPrecisionPolicy(torch.bfloat16, torch.float32))


def _reshard_after_backward_body(ctx: RankContext) -> None:
    ws = ctx.world_size
    local, ours, theirs = _pair(ctx)
    for model in (ours, theirs):
        model.set_reshard_after_backward(False)
    # Both backwards accumulate. The second forward gathers nothing (backward left every unit
    # unsharded); the blocks still reshard after it (reshard_after_forward), so its backward regathers.
    for step in range(2):
        xs = _batches(ctx, step)
        for impl, model in (("reference", ours), ("torch", theirs)):
            with ctx.record_collectives() as forward:
                loss = model(xs[ctx.rank]).sum()
            with ctx.record_collectives() as backward:
                loss.backward()
            gathers = ([len(c.group_ranks) for c in t.calls if c.op == AG] for t in (forward, backward))
            got = tuple(gathers)
            assert got == ([ws] * 4 if step == 0 else [], [ws] * 3), f"{impl} step {step}: {got}"
        _local_backward(local, xs)
        assert not any(unit_state(m).handle.is_resharded for m in (ours, ours.b1, ours.b2, ours.b3))  # type: ignore[union-attr]
    torch.testing.assert_close(_grads(ours), _grads(local), msg=prefixed(f"rank {ctx.rank}: accumulated grads"))
    ours.set_reshard_after_backward(True)
    ours(batch(2, ctx.rank)).sum().backward()
    assert all(unit_state(m).handle.is_resharded for m in (ours, ours.b1, ours.b2, ours.b3))  # type: ignore[union-attr]
    assert all(isinstance(p, DTensor) for p in ours.parameters())


@pytest.mark.ranks(world_size=2)
def test_set_reshard_after_backward(ctx: RankContext) -> None:
    _reshard_after_backward_body(ctx)


def _unshard_body(ctx: RankContext) -> None:
    local = OddModel(seed=0, b2_extra=1)
    for impl, shard in IMPLS.items():
        model = _shard(copy.deepcopy(local), shard, _mesh(ctx))
        names = _unit_bytes(model, ctx.world_size)
        with ctx.record_collectives() as trace:
            model.b2.unshard()
        weight = model.b2.lin.weight
        assert _order(trace, names) == ["b2"] and not isinstance(weight, DTensor), impl
        torch.testing.assert_close(weight.detach(), local.b2.lin.weight.detach(), msg=prefixed(impl))
        pending = model.b3.unshard(async_op=True)
        assert pending is not None
        pending.wait()
        with ctx.record_collectives() as trace:
            model(batch(0, ctx.rank)).sum().backward()
        assert _order(trace, names)[:2] == ["root", "b1"] and _order(trace, names).count("b2") == 1, impl
        model.b2.unshard()
        model.b2.reshard()
        assert isinstance(model.b2.lin.weight, DTensor), impl


@pytest.mark.ranks(world_size=2)
def test_unshard_and_reshard(ctx: RankContext) -> None:
    _unshard_body(ctx)


# -- policies ---------------------------------------------------------------------------------
def _mixed_precision_body(ctx: RankContext) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    local, mesh = OddModel(seed=0, b2_extra=1), _mesh(ctx)
    for output_dtype in (None, torch.float32):
        models = {}
        for impl, shard in IMPLS.items():
            model = copy.deepcopy(local)
            for block in (model.b1, model.b2, model.b3):
                shard(block, mesh=mesh, mp_policy=_as_torch(mp) if impl == "torch" else mp)
            root_mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype)
            models[impl] = shard(model, mesh=mesh, mp_policy=_as_torch(root_mp) if impl == "torch" else root_mp)
            with ctx.record_collectives() as trace:
                out = model(batch(0, ctx.rank))
                out.sum().backward()
            assert out.dtype == (output_dtype or torch.bfloat16), (impl, out.dtype)
            dtypes = {(c.op, c.dtype) for c in trace.calls}
            assert dtypes == {(AG, "bfloat16"), (RS, "float32")}, (impl, trace.render())
            assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters()), impl
            model.zero_grad()
        _train_alike(ctx, models)


@pytest.mark.ranks(world_size=2)
def test_mixed_precision(ctx: RankContext) -> None:
    _mixed_precision_body(ctx)


def _cpu_offload_body(ctx: RankContext) -> None:
    local, ours, theirs = _pair(ctx, offload_policy=CPUOffloadPolicy(pin_memory=False))
    _train_alike(ctx, {"local": local, "reference": ours, "torch": theirs})
    ours(batch(0, ctx.rank)).sum().backward()
    for name, param in ours.named_parameters():
        assert param.to_local().device.type == param.grad.to_local().device.type == "cpu", name


@pytest.mark.ranks(world_size=2)
def test_cpu_offload(ctx: RankContext) -> None:
    _cpu_offload_body(ctx)


# -- frozen, ignored and shared parameters ------------------------------------------------------
def _frozen_body(ctx: RankContext) -> None:
    local = OddModel(seed=0, b2_extra=1)
    local.b2.requires_grad_(False)  # a whole unit, in the middle: backward still passes through it
    local.b3.lin.bias.requires_grad_(False)  # one parameter of a unit
    mesh = _mesh(ctx)
    models = {"local": local} | {impl: _shard(copy.deepcopy(local), shard, mesh) for impl, shard in IMPLS.items()}
    before = _params(models["reference"])
    _train_alike(ctx, models)
    after = _params(models["reference"])
    for name in ("b2.lin.weight", "b2.lin.bias", "b2.scale", "b3.lin.bias"):
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=prefixed(f"{name} trained"))
    for impl in IMPLS:
        with ctx.record_collectives() as trace:
            models[impl](batch(0, ctx.rank)).sum().backward()
        assert trace.count(RS) == 3, f"{impl}: the frozen unit reduced\n{trace.render()}"


@pytest.mark.ranks(world_size=2)
def test_frozen_parameters(ctx: RankContext) -> None:
    _frozen_body(ctx)


def _ignored_body(ctx: RankContext) -> None:
    local = OddModel(seed=0, b2_extra=1)
    mesh = _mesh(ctx)
    models = {}
    for impl, shard in IMPLS.items():
        model = copy.deepcopy(local)
        models[impl] = _shard(model, shard, mesh, ignored_params={model.b2.lin.weight})
        weight = model.b2.lin.weight
        assert isinstance(weight, nn.Parameter) and not isinstance(weight, DTensor), impl
    # Unreduced, the ignored weight's gradient is this rank's own: compare the two implementations.
    _train_alike(ctx, models)


@pytest.mark.ranks(world_size=2)
def test_ignored_params(ctx: RankContext) -> None:
    _ignored_body(ctx)


class _Tied(nn.Module):
    """Two layers sharing one weight, to be sharded as two units."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        self.l2.weight = self.l1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _shared_body(ctx: RankContext) -> None:
    mesh = _mesh(ctx)
    models: dict[str, nn.Module] = {"local": _Tied()}
    for impl, shard in IMPLS.items():
        model = _Tied()
        # torch raises at the root's first forward, the reference at the root's fully_shard.
        with pytest.raises(ValueError, match="Parameter 'l2.weight' is shared with a parameter already managed"):
            shard(model.l1, mesh=mesh)
            shard(model.l2, mesh=mesh)
            shard(model, mesh=mesh)(batch(0, ctx.rank))
        models[impl] = shard(_Tied(), mesh=mesh)  # one unit holding both: the weight stays shared
        assert models[impl].l1.weight is models[impl].l2.weight, impl
    _train_alike(ctx, models)


@pytest.mark.ranks(world_size=2)
def test_parameter_shared_across_units_raises_as_torch_does(ctx: RankContext) -> None:
    _shared_body(ctx)


# -- bad input ------------------------------------------------------------------------------------
def _errors_body(ctx: RankContext) -> None:
    mesh = _mesh(ctx)
    scalar = nn.Module()
    scalar.p = nn.Parameter(torch.tensor(1.0))
    cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: fully_shard(scalar, mesh=mesh), ValueError, "doesn't support scalar parameters. Change p to a 1D"),
        (lambda: fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh), ValueError, "containers"),
        (lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1, ctx.world_size))),
         ValueError, "expects a 1D or 2D DeviceMesh"),
        (lambda: fully_shard(nn.Linear(2, 2), mesh=mesh, reshard_after_forward=3), ValueError,
         "should be a factor of 2, not 3"),
        (lambda: fully_shard(nn.Linear(2, 2), mesh=mesh, reshard_after_forward=1.5), ValueError,  # type: ignore[arg-type]
         "bool or an int representing the group size to reshard to, not 1.5"),
        (lambda: fully_shard(nn.Linear(2, 2), mesh=mesh, mp_policy=torch.bfloat16), TypeError,  # type: ignore[arg-type]
         "mp_policy must be MixedPrecisionPolicy, got torch.bfloat16"),
        (lambda: fully_shard(fully_shard(nn.Linear(2, 2), mesh=mesh), mesh=mesh), ValueError, "already applied"),
        (lambda: FSDP.summon_full_params(fully_shard(nn.Linear(2, 2), mesh=mesh)).__enter__(), TypeError,
         "fully_shard modules hold DTensors"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.ranks(world_size=2, modes=("thread",))
def test_bad_input_names_the_value(ctx: RankContext) -> None:
    _errors_body(ctx)
