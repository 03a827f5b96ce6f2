"""fully_shard_options: the less common ``FSDPModule`` methods, ``fully_shard`` arguments and
``MixedPrecisionPolicy`` fields, each by what a user reads back against the local model
(``fixtures.sharded_blocks``; torch 2.13's docstrings are the oracle).

- ``is_last_backward``: two micro-batches per step, the first backward marked as not the last: after the
  last one the full gradients are the local model's for both micro-batches (what a backward that is not the
  last leaves unfinished is the implementation's; only the last one's gradients are read).
- ``unshard_in_backward``: an embedding (whose backward does not read its weight) in front of the blocks, with
  ``set_unshard_in_backward(False)``: backward all-gathers every unit forward did but the embedding, and two
  steps leave the local model's parameters, the embedding's included.
- ``forward_method``: a method other than ``forward`` of the sharded root, registered as a forward method,
  computes the local model's values and, trained through, leaves the local model's parameters.
- ``output_dtype``: the root's ``MixedPrecisionPolicy(output_dtype=float64)``: the model's output is float64 with
  the local model's values, and training through it leaves the local model's gradients and parameters.
- ``shard_placement_fn``: every weight whose columns split evenly over the ranks sharded on dim 1 (torch requires
  even sharding off dim 0): each parameter's DTensor placement and local piece follow the function, and two
  steps leave the local model's parameters.
- ``custom_comms``: ``b2`` given a custom all-gather and reduce-scatter that count their calls and delegate to
  ``torch.distributed``: they carry all of ``b2``'s collectives (two all-gathers and one reduce-scatter a step,
  as ``reshard_after_forward=True`` promises), and two steps leave the local model's parameters.
- ``reduce_scatter_unused_params``: a layer of the root's unit that only every other rank's forward uses (the
  other ranks' backward gives it no gradient): the full gradients are the local model's mean over every rank's
  loss, step by step, and so are the parameters.
- ``module_group``: ``fully_shard([b2, b3])`` with a float64 ``param_dtype`` and a float32 ``output_dtype``: one
  all-gather a forward for the group and one a backward (resharded after forward), each grouped block
  computing in float64 and returning float32 (torch documents both casts per module of a group), and the
  local model's outputs, gradients and parameters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from conformance.contract import optional
from conformance.contract.adapter import Capability, FSDPAdapter, MixedPrecisionSpec
from conformance.contract.case import TWO_OR_MORE, case
from conformance.contract.optional import fully_shard
from fixtures.blocks import DIM, Blocks, block_batch
from fixtures.parity import assert_close_named
from fixtures.seeding import generator, rank_seed, seeded_init_
from fixtures.sharded_blocks import (
    LR,
    full_grads_of,
    full_of,
    local_grads,
    local_step,
    mesh_over,
    micro_batch_cycles,
    shard_blocks,
    sharded_step,
    trains_as_local,
)

if TYPE_CHECKING:
    from harness import RankContext


@case("fully_shard_options/is_last_backward", clause="C3", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.IS_LAST_BACKWARD])
def test_is_last_backward(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The root's ``set_is_last_backward(False)`` before the first of two micro-batches' backwards, ``True``
    before the second: the full gradients are then the local model's for both, and two such steps leave the
    local model's parameters."""
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx))
    micro_batch_cycles(ctx, impl, model, lambda last: optional.set_is_last_backward(impl, model, last))


AG = "all_gather_into_tensor"
#: Rows of the embedding: its all-gather's bytes differ from every block's and the head's.
VOCAB = 6


class _Embedded(nn.Module):
    """An embedding feeding :class:`Blocks`: backward computes the embedding's gradient from the indices
    alone, without its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = seeded_init_(nn.Embedding(VOCAB, DIM), 7)
        self.blocks = Blocks(seed=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(ids))


def _ids(step: int, rank: int, device: torch.device) -> torch.Tensor:
    return torch.randint(VOCAB, (2,), generator=generator(rank_seed(step, rank))).to(device)


@case("fully_shard_options/unshard_in_backward", clause="C11", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.UNSHARD_IN_BACKWARD])
def test_unshard_in_backward(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The embedding's ``set_unshard_in_backward(False)``: backward all-gathers what forward did but the
    forward's first all-gather (the embedding's: it computes first, the root holds no parameters), and two
    steps leave the local model's parameters."""
    mesh = mesh_over(ctx)
    model = _Embedded().to(ctx.device)
    fully_shard(impl, model.embed, mesh=mesh)
    shard_blocks(impl, model.blocks, mesh)
    fully_shard(impl, model, mesh=mesh)
    optional.set_unshard_in_backward(impl, model.embed, False)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = _Embedded().to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        optim.zero_grad(set_to_none=True)
        with ctx.record_collectives() as forward:
            loss = model(_ids(step, ctx.rank, ctx.device)).sum()
        with ctx.record_collectives() as backward:
            loss.backward()
        optional.step(impl, model, optim)
        gathered = [call.bytes for call in forward.require([AG], "forward's all-gathers")]
        regathered = [call.bytes for call in backward.require([AG], "the blocks' all-gathers in backward")]
        assert Counter(regathered) == Counter(gathered) - Counter(gathered[:1]), (
            f"rank {ctx.rank}, step {step}: backward all-gathered {regathered} bytes, forward {gathered}: "
            "want forward's but the embedding's (the first)")
        local_optim.zero_grad(set_to_none=True)
        local_loss = sum(local(_ids(step, rank, ctx.device)).sum() for rank in range(ctx.world_size))
        (local_loss / ctx.world_size).backward()  # type: ignore[operator]
        local_optim.step()
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


class _Readout(Blocks):
    """:class:`Blocks` with a second entry point that reads out through the root's own ``head`` only."""

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x))


@case("fully_shard_options/forward_method", clause="C1", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.FORWARD_METHODS])
def test_forward_method(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``readout`` of the sharded root, registered as a forward method and called before any ``forward``:
    its outputs are the local model's, two SGD steps on its loss leave the local model's parameters, and
    ``forward`` afterwards computes the local model's outputs."""
    model = _Readout(seed=0).to(ctx.device)
    shard_blocks(impl, model, mesh_over(ctx))
    optional.register_forward_method(impl, model, "readout")
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = _Readout(seed=0).to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        optim.zero_grad(set_to_none=True)
        batch = block_batch(step, ctx.rank, ctx.device)
        out = model.readout(batch)
        assert_close_named({"readout": out.detach()}, {"readout": local.readout(batch).detach()},
                           what=f"rank {ctx.rank}: readout of step {step}")
        out.sum().backward()
        optional.step(impl, model, optim)
        local_optim.zero_grad(set_to_none=True)
        losses = [local.readout(block_batch(step, rank, ctx.device)).sum() for rank in range(ctx.world_size)]
        (torch.stack(losses).sum() / ctx.world_size).backward()
        local_optim.step()
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")
    batch = block_batch(9, ctx.rank, ctx.device)
    assert_close_named({"forward": model(batch).detach()}, {"forward": local(batch).detach()},
                       what=f"rank {ctx.rank}: forward after readout")


@case("fully_shard_options/output_dtype", clause="C13", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.FULLY_SHARD_MIXED_PRECISION, Capability.MIXED_PRECISION,
                Capability.MP_OUTPUT_DTYPE])
def test_output_dtype(ctx: RankContext, impl: FSDPAdapter) -> None:
    """The root sharded with ``output_dtype=torch.float64`` (nothing else in its policy), the blocks without a
    policy: over two SGD steps the output is float64 with the local model's float32 values, and the full
    gradients and then the parameters are the local model's."""
    mesh = mesh_over(ctx)
    model = Blocks(seed=0).to(ctx.device)
    for block in model.blocks():
        fully_shard(impl, block, mesh=mesh)
    policy = MixedPrecisionSpec(output_dtype=torch.float64, cast_forward_inputs=False)
    fully_shard(impl, model, mesh=mesh, mixed_precision=policy)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = Blocks(seed=0).to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        optim.zero_grad(set_to_none=True)
        batch = block_batch(step, ctx.rank, ctx.device)
        out = model(batch)
        assert out.dtype == torch.float64, f"rank {ctx.rank}: the output is {out.dtype}, want torch.float64"
        assert_close_named({"output": out.detach().float()}, {"output": local(batch).detach()},
                           what=f"rank {ctx.rank}: output of step {step}")
        out.sum().backward()
        local_optim.zero_grad(set_to_none=True)
        expected = local_grads(ctx, range(step, step + 1), local)
        assert_close_named(full_grads_of(model), expected, what=f"rank {ctx.rank}: gradients of step {step}")
        optional.step(impl, model, optim)
        local_optim.step()
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


def _on_columns(world_size: int) -> Callable[[nn.Parameter], Shard | None]:
    """``Shard(1)`` for a matrix whose columns split evenly over ``world_size`` ranks, else ``None`` (``Shard(0)``)."""

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param.ndim == 2 and param.shape[1] % world_size == 0 else None

    return placement


@case("fully_shard_options/shard_placement_fn", clause="C1", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.SHARD_PLACEMENT_FN])
def test_shard_placement_fn(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Every unit sharded with a function putting even-column weights on ``Shard(1)``: each parameter is a
    DTensor placed as the function says, its local piece that dim's ``torch.chunk`` of the full one, and two
    SGD steps leave the local model's parameters."""
    mesh = mesh_over(ctx)
    placement = _on_columns(ctx.world_size)
    model = Blocks(seed=0).to(ctx.device)
    for block in model.blocks():
        fully_shard(impl, block, mesh=mesh, shard_placement_fn=placement)
    fully_shard(impl, model, mesh=mesh, shard_placement_fn=placement)
    local = Blocks(seed=0).to(ctx.device)
    assert any(placement(param) is not None for param in local.parameters()), "no parameter is sharded on dim 1"
    for name, param in model.named_parameters():
        want = placement(param) or Shard(0)
        got: Any = param
        assert tuple(got.placements) == (want,), f"rank {ctx.rank}: {name} is placed {got.placements}, want {want}"
        full = local.get_parameter(name).detach()
        pieces = torch.chunk(full, ctx.world_size, dim=want.dim)  # fewer than the ranks: the last ones hold none
        piece = pieces[ctx.rank] if ctx.rank < len(pieces) else full.narrow(want.dim, 0, 0)
        assert_close_named({name: got.to_local().detach()}, {name: piece}, what=f"rank {ctx.rank}: local piece")
    trains_as_local(ctx, impl, model, local)


class _CountingComm:
    """What torch's ``AllGather`` and ``ReduceScatter`` protocols share (duck-typed: a case imports no FSDP): a
    plain allocation, and a count of the collectives issued."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _CountingAllGather(_CountingComm):
    """torch's ``AllGather`` protocol, counting and delegating to ``torch.distributed``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(_CountingComm):
    """torch's ``ReduceScatter`` protocol, counting and delegating to ``torch.distributed``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


@case("fully_shard_options/custom_comms", clause="C1", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.CUSTOM_COMMS])
def test_custom_comms(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``b2``'s all-gathers and reduce-scatters through counting objects that delegate to ``torch.distributed``:
    each of two SGD steps calls the all-gather twice (forward, and backward after resharding) and the
    reduce-scatter once, and the parameters are then the local model's."""
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx))
    all_gather, reduce_scatter = _CountingAllGather(), _CountingReduceScatter()
    optional.set_custom_comms(impl, model.b2, all_gather=all_gather, reduce_scatter=reduce_scatter)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = Blocks(seed=0).to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        sharded_step(ctx, impl, model, optim, step)
        local_step(ctx, local, local_optim, step, range(ctx.world_size))
        calls = (all_gather.calls, reduce_scatter.calls)
        assert calls == (2 * (step + 1), step + 1), (
            f"rank {ctx.rank}: after {step + 1} steps the custom all-gather and reduce-scatter ran {calls} times, "
            f"want {(2 * (step + 1), step + 1)}")
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


class _Gated(Blocks):
    """:class:`Blocks` with an ``extra`` layer in the root's unit that a forward uses only when asked."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.extra = seeded_init_(nn.Linear(DIM, DIM), 3)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out = super().forward(x)
        return out + self.extra(out) if use_extra else out


def _uses_extra(step: int, rank: int) -> bool:
    return (step + rank) % 2 == 1


@case("fully_shard_options/reduce_scatter_unused_params", clause="C2", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.REDUCE_SCATTER_UNUSED_PARAMS])
def test_reduce_scatter_unused_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    """With ``set_reduce_scatter_unused_params(True)`` on the root, half the ranks use ``extra`` in a step (the other
    half in the next): each step's full gradients are the local model's mean over every rank's loss, ``extra``'s
    included, and the parameters after two steps are the local model's."""
    model = _Gated().to(ctx.device)
    shard_blocks(impl, model, mesh_over(ctx))
    optional.set_reduce_scatter_unused_params(impl, model, True)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = _Gated().to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        optim.zero_grad(set_to_none=True)
        model(block_batch(step, ctx.rank, ctx.device), _uses_extra(step, ctx.rank)).sum().backward()
        local_optim.zero_grad(set_to_none=True)
        loss = sum(local(block_batch(step, rank, ctx.device), _uses_extra(step, rank)).sum()
                   for rank in range(ctx.world_size))
        (loss / ctx.world_size).backward()  # type: ignore[operator]
        expected = {name: param.grad for name, param in local.named_parameters() if param.grad is not None}
        assert_close_named(full_grads_of(model), expected, what=f"rank {ctx.rank}: gradients of step {step}")
        optional.step(impl, model, optim)
        local_optim.step()
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


def _dtypes_seen(model: Blocks) -> tuple[dict[str, torch.dtype], Callable[[], None]]:
    """Hooks recording the dtype ``b2`` and ``b3`` compute in (their ``up`` layer's input) and hand on (their
    output, after the implementation's own hooks); the dict they fill, and a function removing them."""
    seen: dict[str, torch.dtype] = {}
    handles = []
    for name in ("b2", "b3"):
        block = getattr(model, name)
        handles.append(block.up.register_forward_pre_hook(
            lambda _m, args, name=name: seen.__setitem__(f"{name} computes in", args[0].dtype)))
        handles.append(block.register_forward_hook(
            lambda _m, _args, out, name=name: seen.__setitem__(f"{name} returns", out.dtype)))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return seen, remove


@case("fully_shard_options/module_group", clause="C1", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.FULLY_SHARD_MODULE_GROUPS, Capability.FULLY_SHARD_MIXED_PRECISION,
                Capability.MP_OUTPUT_DTYPE])
def test_module_group(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``b2`` and ``b3`` sharded by one call as one group, with ``param_dtype=float64, output_dtype=float32``,
    between ``b1`` and the root (neither casting): each forward all-gathers once per unit (``b1``, the group,
    the root: three) and each backward again (all three resharded after forward, the default); each grouped
    block computes in float64 on its float32 input and returns float32 (torch documents both casts per module
    of a group); over two SGD steps the outputs, the full gradients and then the parameters are the local
    model's (float32 tolerances: the group computes more precisely)."""
    mesh = mesh_over(ctx)
    model = Blocks(seed=0).to(ctx.device)
    fully_shard(impl, model.b1, mesh=mesh)
    fully_shard(impl, [model.b2, model.b3], mesh=mesh,
                mixed_precision=MixedPrecisionSpec(param_dtype=torch.float64, output_dtype=torch.float32))
    fully_shard(impl, model, mesh=mesh)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = Blocks(seed=0).to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    seen, remove_hooks = _dtypes_seen(model)
    for step in range(2):
        optim.zero_grad(set_to_none=True)
        batch = block_batch(step, ctx.rank, ctx.device)
        with ctx.record_collectives() as forward:
            out = model(batch)
        gathers = len(forward.require([AG], "forward's all-gathers"))
        assert gathers == 3, f"rank {ctx.rank}, step {step}: forward all-gathered {gathers} times, want 3 (one a unit)"
        want = {"b2 computes in": torch.float64, "b2 returns": torch.float32,
                "b3 computes in": torch.float64, "b3 returns": torch.float32}
        assert seen == want, f"rank {ctx.rank}, step {step}: {seen}, want {want}"
        assert_close_named({"output": out.detach()}, {"output": local(batch).detach()},
                           what=f"rank {ctx.rank}: output of step {step}")
        with ctx.record_collectives() as backward:
            out.sum().backward()
        regathers = len(backward.require([AG], "backward's all-gathers"))
        assert regathers == 3, (f"rank {ctx.rank}, step {step}: backward all-gathered {regathers} times, want 3: "
                                "every unit resharded after forward (the default) is gathered again")
        local_optim.zero_grad(set_to_none=True)
        expected = local_grads(ctx, range(step, step + 1), local)
        assert_close_named(full_grads_of(model), expected, what=f"rank {ctx.rank}: gradients of step {step}")
        optional.step(impl, model, optim)
        local_optim.step()
    remove_hooks()
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")
