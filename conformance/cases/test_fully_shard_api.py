"""fully_shard_api: misuse of per-module sharding is refused when it happens, not discovered later.

- ``misuse[kind=reapply]``: ``fully_shard`` on a module that is already sharded raises.
- ``misuse[kind=container]``: ``fully_shard`` on an ``nn.ModuleList`` (a container without a
  ``forward``, so no forward hook could ever run) raises ``ValueError``.

Both are checked on every rank; the sharded model built before the misuse still trains like the
local model afterwards (a refused call leaves it as it was).

The rest exercise ``FSDPModule`` methods by what a user reads back, against the local model
(``fixtures.sharded_blocks``; torch 2.13's docstrings are the oracle):

- ``reduce_scatter_divide_factor``: the deprecated alias behaves as ``set_gradient_divide_factor``: with
  factor 1 the root's own gradients are the sum over ranks, the blocks' the mean (its
  ``DeprecationWarning`` is not a failure).
- ``requires_all_reduce``: on a 2x2 (replicate, shard) mesh, a backward that reduce-scatters without
  all-reducing, then a synchronizing one, leave the gradients of both micro-batches' mean losses.
- ``all_reduce_hook``: on a 2x2 mesh, a hook scaling ``b2``'s all-reduced gradient in place runs once per
  backward, and ``b2``'s gradients are the local ones scaled, the other modules' unchanged.
- ``reset_iter_state[when=...]``: after an exception raised in ``b2``'s forward or backward and
  ``reset_iter_state()`` on the root, training goes on as if the failed iteration never ran.
- ``mesh_dims[select=...,ranks_on=...]``: a 2-D mesh of the world with every rank on its shard dim (a
  ``1 x N`` mesh) or its replicate dim (``N x 1``). ``positional``: the mesh's dims are named
  ``(replicate, shard)`` and ``fully_shard`` reads them by position; two SGD steps give the local model's
  parameters. ``dp_mesh_dims``: the dims are named otherwise and selected through ``fully_shard``'s
  ``dp_mesh_dims`` (``DataParallelMeshDims(shard=..., replicate=...)``); as its docstring asks, the mesh is
  then the full SPMD mesh, the parameters are first replicated DTensors on it and the module computes on
  DTensors (``distribute_module`` replicating the parameters and the inputs, each rank's batch its own).
  After each step the parameters equal those of the positional mesh's model and of the local model.
- ``tensor_parallel[given=...]``: on a 2 x 2 (dp, tp) mesh, ``b2`` and ``b3`` tensor-parallel over tp (``up``
  column-wise, ``down`` row-wise), then every block and the root sharded over dp. ``submeshes``: torch's
  ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the tp submesh, ``fully_shard`` on the dp
  submesh (the composition torch's tensor-parallel tutorial shows). ``dp_mesh_dims``: the parameters placed by
  hand as DTensors on the whole mesh (replicated over dp), the batch sharded over dp, and ``fully_shard`` given
  the whole mesh with only its dp dim named. Right after sharding every parameter's ``full_tensor()`` is the
  local model's, bit for bit; after each of two SGD steps on each dp rank's own batch it still is (the local
  model steps on the mean of the dp ranks' losses). A ``full_tensor()`` reads the layout ``fully_shard`` gives
  the shards it took from the tensor-parallel pieces (``_StridedShard`` on dp in torch), so a wrong layout
  shows as a permuted full parameter.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from conformance.contract import optional
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, Exact, case
from conformance.contract.optional import fully_shard
from fixtures.blocks import Blocks, block_batch
from fixtures.parity import COPIED, assert_close_named
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


@case("fully_shard_api/misuse", clause="C7", world_size=TWO_OR_MORE, requires=[Capability.FULLY_SHARD], strategies=())
@pytest.mark.parametrize("kind", ["reapply", "container"])
def test_misuse(ctx: RankContext, impl: FSDPAdapter, kind: str) -> None:
    """``fully_shard`` on an already sharded module, or on a container without ``forward``, raises on every
    rank; the model built before still trains like the local model."""
    mesh = mesh_over(ctx)
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh)
    if kind == "reapply":
        with pytest.raises(Exception):  # noqa: B017 - the contract is that it refuses; torch and the reference differ in type
            fully_shard(impl, model.b2, mesh=mesh)
    else:
        container = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]).to(ctx.device)
        with pytest.raises(ValueError):
            fully_shard(impl, container, mesh=mesh)
    trains_as_local(ctx, impl, model, Blocks(seed=0).to(ctx.device), what=f"parameters after {kind}")


#: The hook's scale: a power of two, so scaled gradients compare exactly.
HOOK_SCALE = 4.0


@case("fully_shard_api/reduce_scatter_divide_factor", clause="C2", world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.REDUCE_SCATTER_DIVIDE_FACTOR])
def test_reduce_scatter_divide_factor(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``set_reduce_scatter_divide_factor(1.0)`` on the root, as ``set_gradient_divide_factor(1.0)``: the root's
    own gradients (``head``) are the sum over ranks, the blocks' the mean."""
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch deprecates the alias; not a failure
        optional.set_reduce_scatter_divide_factor(impl, model, 1.0)
    model(block_batch(0, ctx.rank, ctx.device)).sum().backward()
    expected = {name: grad * ctx.world_size if name.startswith("head.") else grad
                for name, grad in local_grads(ctx, range(1)).items()}
    assert_close_named(full_grads_of(model), expected, what=f"rank {ctx.rank}: gradients with divide factor 1")


def _hybrid_blocks(ctx: RankContext, impl: FSDPAdapter) -> Blocks:
    return shard_blocks(impl, Blocks(seed=0).to(ctx.device), ctx.device_mesh((2, 2), ("replicate", "shard")))


@case("fully_shard_api/requires_all_reduce", clause=("C15", "C2"), world_size=4, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.ALL_REDUCE_CONTROLS])
def test_requires_all_reduce(ctx: RankContext, impl: FSDPAdapter) -> None:
    """On a 2x2 mesh, ``set_requires_all_reduce(False)`` for one backward, then ``True`` for the next: after
    the synchronizing backward the gradients are the local model's for both micro-batches, twice in a row."""
    model = _hybrid_blocks(ctx, impl)
    micro_batch_cycles(ctx, impl, model, lambda last: optional.set_requires_all_reduce(impl, model, last))


@case("fully_shard_api/all_reduce_hook", clause=("C15", "C2"), world_size=4, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.ALL_REDUCE_CONTROLS])
def test_all_reduce_hook(ctx: RankContext, impl: FSDPAdapter) -> None:
    """On a 2x2 mesh, a hook on ``b2`` scaling its all-reduced gradient in place runs once per backward; ``b2``'s
    gradients are the local ones times the scale, the other modules' are the local ones."""
    model = _hybrid_blocks(ctx, impl)
    calls: list[int] = []

    def hook(reduce_output: torch.Tensor) -> None:
        calls.append(reduce_output.numel())
        reduce_output.mul_(HOOK_SCALE)

    optional.set_all_reduce_hook(impl, model.b2, hook)
    for step in range(2):
        for param in model.parameters():
            param.grad = None
        model(block_batch(step, ctx.rank, ctx.device)).sum().backward()
        assert len(calls) == step + 1, f"rank {ctx.rank}: the hook ran {len(calls)} times in {step + 1} backwards"
        expected = {name: grad * HOOK_SCALE if name.startswith("b2.") else grad
                    for name, grad in local_grads(ctx, range(step, step + 1)).items()}
        assert_close_named(full_grads_of(model), expected, what=f"rank {ctx.rank}: gradients of step {step}")


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in backward")


@case("fully_shard_api/reset_iter_state", clause=("C1", "C11"), world_size=TWO_OR_MORE, strategies=(),
      requires=[Capability.FULLY_SHARD, Capability.RESET_ITER_STATE])
@pytest.mark.parametrize("when", ["forward", "backward"])
def test_reset_iter_state(ctx: RankContext, impl: FSDPAdapter, when: str) -> None:
    """An exception raised in ``b2``'s forward (or backward) on every rank, then ``reset_iter_state()`` on the
    root: the parameters after two more steps are the local model's after the same three steps."""
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx))
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local = Blocks(seed=0).to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    sharded_step(ctx, impl, model, optim, 0)
    local_step(ctx, local, local_optim, 0, range(ctx.world_size))

    def inject(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if when == "forward":
            raise RuntimeError("injected failure in forward")
        return _FailInBackward.apply(output)  # type: ignore[no-any-return]

    hook = model.b2.register_forward_hook(inject)
    with pytest.raises(RuntimeError, match="injected failure"):
        model(block_batch(9, ctx.rank, ctx.device)).sum().backward()
    hook.remove()
    optional.reset_iter_state(impl, model)
    for step in (1, 2):
        sharded_step(ctx, impl, model, optim, step)
        local_step(ctx, local, local_optim, step, range(ctx.world_size))
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: after a failed {when}")


#: The dim names a ``dp_mesh_dims`` row gives its mesh: not the (replicate, shard) read by position.
SPMD_DIMS = ("dp_replicate", "dp_shard")


def _mesh_dims_requires(params: Mapping[str, Any]) -> list[Capability]:
    return [Capability.FULLY_SHARD] + [Capability.FULLY_SHARD_DP_MESH_DIMS] * (params["select"] == "dp_mesh_dims")


def _as_replicated(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    """Each rank's own batch as a DTensor replicated over the data-parallel mesh (data parallelism's
    convention: the ranks' batches differ, each is computed on where it is)."""
    return tuple(DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False) for x in inputs)


def _as_local(module: nn.Module, output: Any, mesh: Any) -> torch.Tensor:
    return output.to_local()  # type: ignore[no-any-return]


def _spmd_blocks(ctx: RankContext, impl: FSDPAdapter, shape: tuple[int, int]) -> Blocks:
    """``Blocks`` on a full SPMD mesh named :data:`SPMD_DIMS`, replicated there, then sharded through
    ``dp_mesh_dims`` every block and the root."""
    mesh = ctx.device_mesh(shape, SPMD_DIMS)
    model = Blocks(seed=0).to(ctx.device)
    # torch annotates both hooks as returning None; what they return replaces the inputs / the output.
    distribute_module(model, mesh, input_fn=_as_replicated, output_fn=_as_local)  # type: ignore[arg-type]
    dims = (SPMD_DIMS[1], SPMD_DIMS[0])
    for block in model.blocks():
        fully_shard(impl, block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(impl, model, mesh=mesh, dp_mesh_dims=dims)
    return model


@case("fully_shard_api/mesh_dims", clause=("C15", "C1"), world_size=TWO_OR_MORE, strategies=(),
      requires=_mesh_dims_requires)
@pytest.mark.parametrize("ranks_on", ["shard", "replicate"])
@pytest.mark.parametrize("select", ["positional", "dp_mesh_dims"])
def test_mesh_dims(ctx: RankContext, impl: FSDPAdapter, select: str, ranks_on: str) -> None:
    """On a 2-D mesh with every rank on its ``ranks_on`` dim, the dims read by position or selected through
    ``dp_mesh_dims`` train alike, and like the local model, two SGD steps."""
    shape = (1, ctx.world_size) if ranks_on == "shard" else (ctx.world_size, 1)
    models = {"positional": shard_blocks(impl, Blocks(seed=0).to(ctx.device), ctx.device_mesh(shape, ("replicate",
                                                                                                       "shard")))}
    if select == "dp_mesh_dims":
        models[select] = _spmd_blocks(ctx, impl, shape)
    optims = {name: optional.optimizer(impl, model, torch.optim.SGD, lr=LR) for name, model in models.items()}
    local = Blocks(seed=0).to(ctx.device)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(2):
        for name, model in models.items():
            sharded_step(ctx, impl, model, optims[name], step)
        local_step(ctx, local, local_optim, step, range(ctx.world_size))
        full = {name: full_of(model) for name, model in models.items()}
        what = f"rank {ctx.rank}, step {step}, every rank on the {ranks_on} dim"
        assert_close_named(full["positional"], dict(local.named_parameters()), what=f"{what}: positional dims")
        if select == "dp_mesh_dims":
            assert_close_named(full[select], full["positional"], what=f"{what}: dp_mesh_dims vs positional dims")


#: A ``dp x tp`` mesh's dim names; the tp dim is the last, as tensor parallelism's usually is.
TP_DIMS = ("dp", "tp")
#: The blocks of ``Blocks`` whose hidden size splits over 2 ranks: their ``up`` is column-wise and their ``down``
#: row-wise tensor-parallel (Megatron's split); every other parameter is replicated over tp.
TP_BLOCKS = ("b2", "b3")
#: Those parameters' placements on the tp dim, for the ``dp_mesh_dims`` rows, which place them by hand.
TP_PLACEMENTS: dict[str, Shard] = {f"{block}.{name}": placement for block in TP_BLOCKS for name, placement in
                                   (("up.weight", Shard(0)), ("up.bias", Shard(0)), ("down.weight", Shard(1)))}


def _tensor_parallel(name: str, module: nn.Module, mesh: Any) -> None:
    """``distribute_module``'s ``partition_fn``: ``module``'s own parameters as DTensors on ``mesh``, replicated over
    dp and placed over tp as :data:`TP_PLACEMENTS` says (replicated if absent); every rank holds the full values."""
    for attr, param in list(module.named_parameters(recurse=False)):
        placement = TP_PLACEMENTS.get(f"{name}.{attr}".lstrip("."), Replicate())
        dtensor = distribute_tensor(param.detach(), mesh, [Replicate(), placement], src_data_rank=None)
        module.register_parameter(attr, nn.Parameter(dtensor))


def _batch_sharded(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    """Each dp rank's own batch as its rows of a batch sharded over dp, replicated over tp."""
    return tuple(DTensor.from_local(x, mesh, [Shard(0), Replicate()], run_check=False) for x in inputs)


def _own_rows(module: nn.Module, output: Any, mesh: Any) -> torch.Tensor:
    """This dp rank's rows of the output, whole over tp."""
    return output.redistribute(mesh, [Shard(0), Replicate()]).to_local()  # type: ignore[no-any-return]


def _tp_blocks(ctx: RankContext, impl: FSDPAdapter, given: str) -> tuple[Blocks, Any]:
    """``Blocks`` tensor-parallel over the tp dim of a 2 x 2 (dp, tp) mesh, then sharded over its dp dim, every
    block and the root; and the mesh. ``submeshes``: ``parallelize_module`` on the tp submesh, ``fully_shard`` on the
    dp submesh. ``dp_mesh_dims``: DTensors on the whole mesh, which ``fully_shard`` gets with the dp dim named."""
    mesh = ctx.device_mesh((2, 2), TP_DIMS)
    model = Blocks(seed=0).to(ctx.device)
    if given == "submeshes":
        plan = {f"{block}.{name}": style for block in TP_BLOCKS
                for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}
        parallelize_module(model, mesh[TP_DIMS[1]], plan)  # type: ignore[arg-type]
        for module in [*model.blocks(), model]:
            fully_shard(impl, module, mesh=mesh[TP_DIMS[0]])
        return model, mesh
    # torch annotates both hooks as returning None; what they return replaces the inputs / the output.
    distribute_module(model, mesh, _tensor_parallel, input_fn=_batch_sharded, output_fn=_own_rows)  # type: ignore[arg-type]
    for module in [*model.blocks(), model]:
        fully_shard(impl, module, mesh=mesh, dp_mesh_dims=(TP_DIMS[0], None))
    return model, mesh


def _tp_requires(params: Mapping[str, Any]) -> list[Capability]:
    dims = [Capability.FULLY_SHARD_DP_MESH_DIMS] * (params["given"] == "dp_mesh_dims")
    return [Capability.FULLY_SHARD, Capability.FULLY_SHARD_TENSOR_PARALLEL, *dims]


@case("fully_shard_api/tensor_parallel", clause=("C15", "C1"), world_size=Exact(4, reason="a 2 x 2 (dp, tp) mesh"),
      strategies=(), requires=_tp_requires)
@pytest.mark.parametrize("given", ["submeshes", "dp_mesh_dims"])
def test_tensor_parallel(ctx: RankContext, impl: FSDPAdapter, given: str) -> None:
    """Tensor-parallel blocks (column-wise ``up``, row-wise ``down``) on a 2 x 2 (dp, tp) mesh, sharded over dp:
    the parameters' full values are the local model's, and stay so over two SGD steps on each dp rank's batch."""
    model, mesh = _tp_blocks(ctx, impl, given)
    local = Blocks(seed=0).to(ctx.device)
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: sharded", exact=COPIED)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    dp_rank = mesh.get_local_rank(TP_DIMS[0])
    for step in range(2):
        optim.zero_grad(set_to_none=True)
        model(block_batch(step, dp_rank, ctx.device)).sum().backward()
        optional.step(impl, model, optim)
        local_step(ctx, local, local_optim, step, range(mesh.size(0)))
        assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: step {step}")
