"""mixed_precision: param / reduce / buffer dtypes, low-precision gradients, full precision in eval,
the root's cast of its inputs, the dtype gradients kept without sync add up in.

Each case trains :class:`~fixtures.precision.ScaledMLP` (units: ``lin1``,
``lin2``, the root with the buffer) on two ranks with SGD, next to
:class:`~fixtures.precision.LocalMixedPrecision`, the same training emulated in
one process in the same dtypes ([Note: local mixed precision]). Every step
checks the dtypes the implementation computes in (weights inside the unit's
forward, inputs, buffers, output), the dtypes its collectives carry (recorded:
all-gathers in the param dtype, gradient reductions in the reduce dtype), the
dtype of the sharded parameters and gradients the optimizer sees, and the
values of losses, gradients and parameters against the emulation with
``torch.testing.assert_close``'s defaults for their dtype.

``cast_unit_forward_inputs[cast=True|False]`` is FSDP1's ``MixedPrecision.cast_forward_inputs``
(torch 2.13: "If ``True``, then this FSDP module casts its forward args and kwargs to
``param_dtype``", where ``cast_root_forward_inputs`` covers the root alone): a root computing in
bfloat16 hands its nested unit a float32 tensor; the nested module's forward sees it in bfloat16 with the
option, in float32 without it.

``non_floating_inputs[api=wrap|fully_shard]`` feeds the root float32 features, int64 token ids and a bool mask
under a bfloat16 policy that casts inputs: its forward sees the features in bfloat16 and the others unchanged
(both torch APIs document the cast as one of floating-point tensors), and computes the local bfloat16 model's
output.

Only ``cast_forward_inputs``, ``cast_unit_forward_inputs`` and ``non_floating_inputs`` feed float32 inputs and
rely on the implementation casting them (``Capability.MP_CAST_FORWARD_INPUTS``, and ``MP_CAST_UNIT_FORWARD_INPUTS``;
under ``fully_shard``, ``FULLY_SHARD_MIXED_PRECISION``, whose policy casts by default);
every other case casts its batches to the param dtype itself
(``MixedPrecisionSpec(cast_forward_inputs=False)``), so it needs no more than the dtypes it tests.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, MixedPrecisionSpec, WrapSpec
from conformance.contract.case import TWO_OR_MORE, Exact, Scalable, case
from conformance.contract.messages import FULL_PRECISION_IN_EVAL
from conformance.contract.optional import full_grads, fully_shard
from conformance.fuzz.example import ModelSpec, Policy
from conformance.fuzz.gathers import GATHERS
from conformance.fuzz.ops import FullyShardConfig, WrapConfig
from conformance.fuzz.unsynced import keeps_unsynced_sums
from fixtures.parity import assert_close_named
from fixtures.precision import LocalMixedPrecision, ScaledMLP, low_precision_loss
from fixtures.seeding import generator, rank_seed, seeded_init_
from fixtures.sharded_blocks import mesh_over

if TYPE_CHECKING:
    from harness import RankContext

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LINEARS = AutoWrap(module_classes=(nn.Linear,))
REDUCTIONS = ("reduce_scatter_tensor", "reduce_scatter", "all_reduce")
#: A reduction in a low-precision dtype equals the local baseline's bit for bit only at 2 ranks
#: ([Note: local mixed precision]): at 3 its division rounds, at 4 its sum depends on the order.
LOW_PRECISION_REDUCTION = Exact(2, reason="its low-precision reductions equal the local baseline at 2 ranks only")


def _reduction_need(params: Mapping[str, Any]) -> Exact | Scalable:
    """A row reducing in float32 runs at any world size from 2: the ranks' float32 gradients summed in any
    order and divided before or after differ from the baseline's by a few float32 roundings, within the
    float32 tolerance of the gradient and parameter checks. A row reducing in its low-precision param dtype
    runs at 2 ranks only (:data:`LOW_PRECISION_REDUCTION`)."""
    return TWO_OR_MORE if params["reduce_dtype"] == "float32" else LOW_PRECISION_REDUCTION
STEPS = 3


@dataclass
class _Pair:
    """The wrapped model and the local emulation, trained side by side."""

    impl: FSDPAdapter
    model: nn.Module
    module: ScaledMLP  # the unwrapped root module object, for its recorded dtypes
    local: LocalMixedPrecision
    mp: MixedPrecisionSpec
    strategy: str

    @property
    def grad_dtype(self) -> torch.dtype:
        """float32, or with keep_low_precision_grads the dtype gradients were reduced in."""
        reduce = self.mp.reduce_dtype or self.mp.param_dtype
        assert reduce is not None
        return reduce if self.mp.keep_low_precision_grads else torch.float32


def _pair(ctx: RankContext, impl: FSDPAdapter, mp: MixedPrecisionSpec, strategy: str,
          auto_wrap: AutoWrap | None = LINEARS) -> _Pair:
    module = ScaledMLP(seed=0).to(ctx.device)
    master = ScaledMLP(seed=0).to(ctx.device)
    assert mp.param_dtype is not None
    local = LocalMixedPrecision(
        master, mp.param_dtype, mp.reduce_dtype or mp.param_dtype, mp.buffer_dtype, mp.keep_low_precision_grads
    )
    spec = WrapSpec(strategy=strategy, auto_wrap=auto_wrap, use_orig_params=True, mixed_precision=mp)
    return _Pair(impl, impl.wrap(module, spec), module, local, mp, strategy)


def _batches(ctx: RankContext, step: int) -> list[torch.Tensor]:
    return [torch.randn((4, 8), generator=generator(rank_seed(step, r))).to(ctx.device) for r in range(ctx.world_size)]


def _dtypes(trace: Any, ops: tuple[str, ...]) -> set[str]:
    return {call.dtype for call in trace.calls if call.op in ops}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_collectives(pair: _Pair, trace: Any, step: int) -> None:
    """The dtypes the step's collectives carry, not how many there are: every all-gather carries the
    param dtype and there is at least one (none for NO_SHARD), every gradient reduction (reduce-scatter
    or all-reduce, per unit or per parameter alike) carries the reduce dtype and there is at least one."""
    assert pair.mp.param_dtype is not None
    param, reduce = pair.mp.param_dtype, pair.mp.reduce_dtype or pair.mp.param_dtype
    gathers, reductions = _dtypes(trace, GATHERS), _dtypes(trace, REDUCTIONS)
    want_gathers = set() if pair.strategy == "NO_SHARD" else {_name(param)}
    assert gathers == want_gathers, f"step {step}: all-gathers carried {gathers}, expected {want_gathers}"
    assert reductions == {_name(reduce)}, f"step {step}: gradient reductions carried {reductions}, expected {reduce}"


def _check_compute_dtypes(pair: _Pair, output: torch.Tensor, step: int) -> None:
    """The root's forward sees its input in the param dtype (cast by the case, or with
    ``cast_forward_inputs`` by the implementation), ``lin1`` its weight, the output comes out in it."""
    param = pair.mp.param_dtype
    buffer = pair.mp.buffer_dtype or torch.float32
    seen = {"output": output.dtype, "input": pair.module.seen["input"], "buffer": pair.module.seen["scale"],
            "lin1.weight in forward": pair.module.lin1.seen["weight"]}
    want = {"output": param, "input": param, "buffer": buffer, "lin1.weight in forward": param}
    assert seen == want, f"step {step}: computed in {seen}, expected {want}"


def _check_sharded_dtypes(pair: _Pair, step: int) -> None:
    for unit in pair.impl.units(pair.model):
        shards = {s.dtype for s in unit.local_shards}
        grads = {g.dtype for g in unit.held_grads() if g is not None}
        assert shards <= {torch.float32}, f"step {step}: unit {unit.fqn!r} shards in {shards}, expected float32"
        want = pair.grad_dtype
        assert grads <= {want}, f"step {step}: unit {unit.fqn!r} grads in {grads}, expected {want}"
    assert any(g is not None for u in pair.impl.units(pair.model) for g in u.held_grads()), "no unit has a gradient"


def train_step(ctx: RankContext, pair: _Pair, optim: torch.optim.Optimizer, step: int) -> None:
    """One recorded step on both sides; every dtype and value check of the module docstring. Without
    ``cast_forward_inputs`` the case hands the model its batch in the param dtype."""
    batches = _batches(ctx, step)
    x = batches[ctx.rank] if pair.mp.cast_forward_inputs else batches[ctx.rank].to(pair.local.param_dtype)
    with ctx.record_collectives() as trace:
        output = pair.model(x)
        loss = low_precision_loss(output)
        loss.backward()
    want_losses = pair.local.forward_backward(batches)
    _check_compute_dtypes(pair, output, step)
    _check_collectives(pair, trace, step)
    _check_sharded_dtypes(pair, step)
    torch.testing.assert_close(loss.detach(), want_losses[ctx.rank], msg=lambda m: f"step {step} loss: {m}")
    got = full_grads(pair.impl, pair.model)
    assert got is not None, f"{pair.impl.name} cannot report full gradients"
    assert_close_named({n: g for n, g in got.items() if g is not None}, pair.local.grads, what=f"step {step} grads")
    optional.step(pair.impl, pair.model, optim)
    optim.zero_grad(set_to_none=True)
    pair.local.step()
    want = {n: p.detach() for n, p in pair.local.master.named_parameters()}
    assert_close_named(pair.impl.full_params(pair.model), want, what=f"step {step} params")


def _train(ctx: RankContext, pair: _Pair, steps: int = STEPS) -> None:
    optim = optional.optimizer(pair.impl, pair.model, torch.optim.SGD, lr=pair.local.lr)
    for step in range(steps):
        train_step(ctx, pair, optim, step)


@case("mixed_precision/param_and_reduce_dtypes", clause="C13", world_size=_reduction_need,
      requires=[Capability.MIXED_PRECISION])
@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype", "strategy"),
    [
        ("bfloat16", "float32", "FULL_SHARD"),
        ("bfloat16", None, "FULL_SHARD"),
        ("float16", "float32", "FULL_SHARD"),
        ("bfloat16", "float32", "NO_SHARD"),
        ("float16", None, "NO_SHARD"),
    ],
)
def test_param_and_reduce_dtypes(
    ctx: RankContext, impl: FSDPAdapter, param_dtype: str, reduce_dtype: str | None, strategy: str
) -> None:
    """Compute and all-gather in the param dtype, reduce in the reduce dtype (the param dtype when
    unset), keep full-precision shards and gradients; train like the local emulation."""
    mp = MixedPrecisionSpec(param_dtype=DTYPES[param_dtype], reduce_dtype=reduce_dtype and DTYPES[reduce_dtype],
                            cast_forward_inputs=False)
    _train(ctx, _pair(ctx, impl, mp, strategy))


@case("mixed_precision/cast_forward_inputs", clause="C13", world_size=TWO_OR_MORE,
      requires=[Capability.MIXED_PRECISION, Capability.MP_CAST_FORWARD_INPUTS])
@pytest.mark.parametrize(("param_dtype", "strategy"), [("bfloat16", "FULL_SHARD"), ("float16", "NO_SHARD")])
def test_cast_forward_inputs(ctx: RankContext, impl: FSDPAdapter, param_dtype: str, strategy: str) -> None:
    """Fed float32 batches, the root's forward sees them in the param dtype (cast before it runs), and
    outputs, losses, grads and params are those of the emulation computing on the cast batch."""
    mp = MixedPrecisionSpec(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)
    _train(ctx, _pair(ctx, impl, mp, strategy))


@case("mixed_precision/keep_low_precision_grads", clause="C13", world_size=_reduction_need,
      requires=[Capability.MIXED_PRECISION, Capability.MP_KEEP_LOW_PRECISION_GRADS])
@pytest.mark.parametrize(
    ("reduce_dtype", "strategy"),
    [(None, "FULL_SHARD"), (None, "NO_SHARD"), ("float32", "FULL_SHARD"), ("float32", "NO_SHARD")],
)
def test_keep_low_precision_grads(ctx: RankContext, impl: FSDPAdapter, reduce_dtype: str | None, strategy: str) -> None:
    """Gradients reach the optimizer in the dtype they were reduced in, not upcast (torch's
    documented ``keep_low_precision_grads``); values as emulated."""
    mp = MixedPrecisionSpec(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype and DTYPES[reduce_dtype],
                            keep_low_precision_grads=True, cast_forward_inputs=False)
    _train(ctx, _pair(ctx, impl, mp, strategy))


@case("mixed_precision/buffer_dtype", clause="C13", world_size=TWO_OR_MORE,
      requires=[Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE])
@pytest.mark.parametrize("buffer_dtype", ["bfloat16", "float16"])
def test_buffer_dtype(ctx: RankContext, impl: FSDPAdapter, buffer_dtype: str) -> None:
    """Buffers compute in the buffer dtype, independently of the param dtype."""
    mp = MixedPrecisionSpec(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=DTYPES[buffer_dtype],
                            cast_forward_inputs=False)
    _train(ctx, _pair(ctx, impl, mp, "FULL_SHARD"))


@case("mixed_precision/buffer_dtype_state_dict", clause=("C13", "C4"), world_size=TWO_OR_MORE,
      requires=[Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE, Capability.FULL_STATE_DICT])
@pytest.mark.parametrize("units", ["one", "nested"])
def test_buffer_dtype_state_dict(ctx: RankContext, impl: FSDPAdapter, units: str) -> None:
    """After a step with ``buffer_dtype=bfloat16``, a full state dict holds the buffer in float32, the dtype
    it was built in ("saved in full precision"), with the values it computes with (cast at the first
    forward, "keeps them in that dtype thereafter"), and the parameters' values; training then goes on as
    emulated, the buffer still computing in bfloat16. ``one``: one unit holding the buffer and every
    parameter. ``nested``: each ``Linear`` its own unit, so the unit holding the buffer (the root) manages
    no parameter of its own; the documented contract names no layout."""
    mp = MixedPrecisionSpec(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16,
                            cast_forward_inputs=False)
    pair = _pair(ctx, impl, mp, "FULL_SHARD", auto_wrap=LINEARS if units == "nested" else None)
    optim = optional.optimizer(impl, pair.model, torch.optim.SGD, lr=pair.local.lr)
    train_step(ctx, pair, optim, 0)
    state = impl.full_state_dict(pair.model)
    master = pair.local.master
    want = {n: p.detach() for n, p in master.named_parameters()}
    want.update({n: b.to(torch.bfloat16).to(b.dtype) for n, b in master.named_buffers()})
    dtypes = {n: v.dtype for n, v in state.items()}
    assert dtypes == {n: v.dtype for n, v in want.items()}, f"full state dict dtypes {dtypes}, expected the built ones"
    assert_close_named(state, want, what="full state dict after a step")
    for step in range(1, STEPS):
        train_step(ctx, pair, optim, step)


@case("mixed_precision/full_precision_in_eval", clause="C13", world_size=TWO_OR_MORE, env={FULL_PRECISION_IN_EVAL: "1"},
      requires=[Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE, Capability.MP_FULL_PRECISION_IN_EVAL])
def test_full_precision_in_eval(ctx: RankContext, impl: FSDPAdapter) -> None:
    """In eval, a unit gathers and computes in full precision (buffers too) on a float32 batch and
    matches the float32 model; back in train mode it is mixed precision again (bfloat16 batches)."""
    mp = MixedPrecisionSpec(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16,
                            cast_forward_inputs=False)
    pair = _pair(ctx, impl, mp, "FULL_SHARD")
    _train(ctx, pair, steps=1)
    pair.model.eval()
    pair.local.master.eval()
    x = _batches(ctx, 100)[ctx.rank]
    with torch.no_grad(), ctx.record_collectives() as trace:
        output = pair.model(x)
    # Dtypes only: every eval all-gather carries float32, and there is at least one.
    gathers = _dtypes(trace, GATHERS)
    assert gathers == {"float32"}, f"eval all-gathers carried {gathers}, expected float32"
    seen = {"output": output.dtype, "buffer": pair.module.seen["scale"], "lin1.weight": pair.module.lin1.seen["weight"]}
    assert set(seen.values()) == {torch.float32}, f"eval computed in {seen}, expected float32 throughout"
    # Buffers stay in the buffer dtype after the first forward (torch's documented contract), so
    # the float32 model's buffers are rounded through it.
    for buf in pair.local.master.buffers():
        buf.data = buf.data.to(torch.bfloat16).to(buf.dtype)
    with torch.no_grad():
        torch.testing.assert_close(output, pair.local.master(x), msg=lambda m: f"eval output vs float32 model: {m}")
    pair.model.train()
    output = pair.model(x.to(torch.bfloat16))
    assert output.dtype == torch.bfloat16, "back in train mode the output should be bfloat16 again"


def _unsynced_requires(params: Mapping[str, Any]) -> list[Capability]:
    if params.get("api") == "fully_shard":
        return [Capability.FULLY_SHARD, Capability.FULLY_SHARD_MIXED_PRECISION, Capability.FULLY_SHARD_CONTROLS]
    return [Capability.MIXED_PRECISION, Capability.NO_SYNC]


@case("mixed_precision/unsynced_sums", clause=("C13", "C3"), world_size=TWO_OR_MORE, requires=_unsynced_requires)
@pytest.mark.parametrize(("api", "param_dtype"), [("wrap", "bfloat16"), ("wrap", "float16"),
                                                  ("fully_shard", "bfloat16")])
def test_unsynced_sums(ctx: RankContext, impl: FSDPAdapter, api: str, param_dtype: str) -> None:
    """Reducing in float32, a backward without gradient sync (``no_sync()``; ``set_requires_gradient_sync``
    under ``fully_shard``) and the next one leave each rank's sum kept in the dtype the API documents: the
    param dtype for ``no_sync()``, ``reduce_dtype`` for FSDP2 ([Note: unsynced sums made to show] in
    conformance/fuzz/unsynced.py)."""
    kind = WrapConfig if api == "wrap" else FullyShardConfig
    keeps_unsynced_sums(ctx, impl, kind(world_size=ctx.world_size, model=ModelSpec(width=4),
                                        policy=Policy(param_dtype=param_dtype, reduce_dtype="float32")))


class _RecordsInput(nn.Module):
    """A ``Linear`` that records the dtype of each input its forward sees and computes in its weight's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


class _Upcasts(nn.Module):
    """The root's own layer, its output upcast to float32 and handed to ``inner``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.inner = _RecordsInput()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.head(x).float())


@case("mixed_precision/cast_unit_forward_inputs", clause="C13", world_size=TWO_OR_MORE,
      requires=[Capability.MIXED_PRECISION, Capability.MP_CAST_FORWARD_INPUTS, Capability.MP_CAST_UNIT_FORWARD_INPUTS])
@pytest.mark.parametrize("cast", [True, False])
def test_cast_unit_forward_inputs(ctx: RankContext, impl: FSDPAdapter, cast: bool) -> None:
    """A nested unit's forward sees the float32 tensor its caller hands it in bfloat16 with
    ``cast_unit_forward_inputs``, in float32 without it."""
    plain = _Upcasts().to(ctx.device)
    seeded_init_(plain, 0)
    policy = MixedPrecisionSpec(param_dtype=torch.bfloat16, cast_unit_forward_inputs=cast)
    model = impl.wrap(plain, WrapSpec(mixed_precision=policy, auto_wrap=AutoWrap.submodules(plain, [plain.inner])))
    model(torch.randn(2, 4, generator=generator(rank_seed(0, ctx.rank))).to(ctx.device)).sum().backward()
    want = torch.bfloat16 if cast else torch.float32
    assert plain.inner.seen == [want], (
        f"rank {ctx.rank}: the nested unit's forward saw inputs in {plain.inner.seen}, expected [{want}]")


class _TakesTokens(nn.Module):
    """Features, token ids and a mask: records the dtypes its forward sees, adds the tokens' embedding to the
    features' projection and masks the sum (what a model fed a tokenized batch does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.embed = nn.Embedding(5, 4)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, ids.dtype, mask.dtype))
        return (self.lin(x) + self.embed(ids)) * mask.unsqueeze(-1)


def _cast_requires(params: Mapping[str, Any]) -> list[Capability]:
    if params.get("api") == "fully_shard":
        return [Capability.FULLY_SHARD, Capability.FULLY_SHARD_MIXED_PRECISION]
    return [Capability.MIXED_PRECISION, Capability.MP_CAST_FORWARD_INPUTS]


@case("mixed_precision/non_floating_inputs", clause="C13", world_size=TWO_OR_MORE, requires=_cast_requires)
@pytest.mark.parametrize("api", ["wrap", "fully_shard"])
def test_non_floating_inputs(ctx: RankContext, impl: FSDPAdapter, api: str) -> None:
    """The root casting its inputs to bfloat16 (FSDP1's ``cast_forward_inputs``/``cast_root_forward_inputs``,
    FSDP2's ``MixedPrecisionPolicy.cast_forward_inputs``: torch documents both as casting the
    floating-point tensors) casts a float32 positional input and leaves int64 token ids and a keyword bool
    mask as they are; the output is the local model's computed in bfloat16 on the same inputs."""
    plain = _TakesTokens().to(ctx.device)
    seeded_init_(plain, 0)
    local = copy.deepcopy(plain).to(torch.bfloat16)
    policy = MixedPrecisionSpec(param_dtype=torch.bfloat16)
    if api == "wrap":
        model = impl.wrap(plain, WrapSpec(mixed_precision=policy))
    else:
        model = fully_shard(impl, plain, mesh=mesh_over(ctx), mixed_precision=policy)
    gen = generator(rank_seed(0, ctx.rank))
    x, ids = torch.randn(2, 3, 4, generator=gen), torch.randint(0, 5, (2, 3), generator=gen)
    x, ids, mask = x.to(ctx.device), ids.to(ctx.device), (ids % 2 == 0).to(ctx.device)
    out = model(x, ids, mask=mask)
    want = (torch.bfloat16, torch.int64, torch.bool)
    assert plain.seen == [want], f"rank {ctx.rank}: the root's forward saw {plain.seen}, expected [{want}]"
    assert_close_named({"output": out.detach()}, {"output": local(x.to(torch.bfloat16), ids, mask=mask).detach()},
                       what=f"rank {ctx.rank}: output")
