"""training: FSDP trains like the model it wraps.

A wrapped model, trained on every rank's batch, matches DistributedDataParallel
(or the local model) step for step, for every strategy and optimizer, and
modules whose outputs need no gradient train their other parameters. Helpers
and the note on CPU groups are in ``fixtures/cpu_groups.py`` ([Note: CPU groups]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from conformance.contract import optional
from conformance.contract.adapter import HYBRID_STRATEGIES, STRATEGIES, AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, Scalable, case, not_applicable
from fixtures.baselines import cached
from fixtures.cpu_groups import cpu_world_group, hybrid_cpu_groups
from fixtures.meshes import ranks_per_node
from fixtures.models import (
    OptionalSecondOutputModel,
    SumOfInputsModel,
)
from fixtures.optimizers import OPTIMIZERS, make_optim, wrapped_optim
from fixtures.parity import StepRecord, assert_runs_match, run_steps
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

ALWAYS = AutoWrap(kind="always")
CPU = torch.device("cpu")


def _sum_loss(output: Any, _batch: tuple[Any, ...]) -> torch.Tensor:
    return output.sum()


def _pg_tuple_for_hybrid(params: Mapping[str, Any]) -> list[Capability]:
    return [Capability.HYBRID_VIA_PG_TUPLE] if params["strategy"] in HYBRID_STRATEGIES else []


@case("training/cpu_training_parity_vs_ddp", world_size=Scalable(default=4, minimum=4, multiple_of=2),
      timeout_s=180.0, requires=_pg_tuple_for_hybrid,
      clause=("C1", "C2"))
@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_cpu_training_parity_vs_ddp(ctx: RankContext, impl: FSDPAdapter, strategy: str, optim: str) -> None:
    """10 steps with ``device_id=cpu``: every step's loss equals DDP's on the same data.

    Hybrid strategies shard within a node and replicate across nodes (``ranks_per_node``: nodes of 2, or a
    launched job's own) through an explicit group pair, and every unit owning parameters must then report
    a replicate group of one rank per node.
    Adam as in the seed, and SGD with momentum, which a wrong gradient scale changes.
    """
    world = cpu_world_group(ctx)
    node = ranks_per_node(ctx)
    group: Any = hybrid_cpu_groups(ctx, shard_size=node) if strategy in HYBRID_STRATEGIES else world
    inp = torch.randn((2, 2), generator=generator(rank_seed(42, ctx.rank)))
    batches = [(inp, inp)] * 10

    def ddp_run() -> list[StepRecord]:
        ddp = DistributedDataParallel(SumOfInputsModel(seed=42), process_group=world)
        return run_steps(ddp, make_optim(optim, ddp.parameters()), batches, _sum_loss)

    fsdp = impl.wrap(SumOfInputsModel(seed=42),
                     WrapSpec(strategy=strategy, auto_wrap=ALWAYS, process_group=group, device_id=CPU))
    runs = {  # DDP's run is the same for every strategy: computed once ([Note: baseline cache])
        "ddp": cached("ddp-steps", {"model": SumOfInputsModel, "seed": 42, "optim": optim, "batches": batches,
                                    "loss": _sum_loss, "world": ctx.world_size, "rank": ctx.rank,
                                    "rank_batches": "randn((2, 2)) from rank_seed(42, rank)"}, ddp_run, group=world),
        impl.name: run_steps(fsdp, wrapped_optim(impl, fsdp, optim), batches, _sum_loss, adapter=impl),
    }
    assert_runs_match(runs, reference="ddp")
    if strategy in HYBRID_STRATEGIES:
        # Units are inspected after training: before the first forward an
        # implementation may not have built its per-unit runtime state yet.
        sizes = {
            1 if u.replicate_group is None else torch.distributed.get_world_size(u.replicate_group)
            for u in impl.units(fsdp)
            if u.local_shards
        }
        replicas = ctx.world_size // node
        assert sizes == {replicas}, (f"{strategy}: replicate group sizes {sizes}, expected {{{replicas}}} "
                                     f"({node} x {replicas} hybrid)")


@case("training/module_no_compute_grad", clause=("C1", "C2"), world_size=TWO_OR_MORE)
@pytest.mark.parametrize("use_second_layer", [True, False])
@pytest.mark.parametrize("strategy", ["NO_SHARD", None])
def test_module_no_compute_grad(
    ctx: RankContext, impl: FSDPAdapter, strategy: str | None, use_second_layer: bool
) -> None:
    """Over four steps, unit ``b`` outside the loss (unused, or used only for an ignored output) keeps every
    local grad None while unit ``a``, in the loss, has them all. ``n/a`` where the strategy makes no unit per
    module (``units_per_module``)."""
    if not optional.units_per_module(impl, strategy):
        not_applicable(f"{impl.name} makes no unit per module under strategy {strategy}: no unit 'a' or 'b' to ask")
    spec = WrapSpec(strategy=strategy, auto_wrap=ALWAYS)
    model = impl.wrap(OptionalSecondOutputModel(use_second_layer, seed=0).to(ctx.device), spec)
    gen = generator(rank_seed(0, ctx.rank))
    x = torch.randn((10, 10), generator=gen).to(ctx.device)
    y = torch.randn((10, 10), generator=gen).to(ctx.device)
    for step in range(4):
        out = model(x, y)
        (out[0] if use_second_layer else out).sum().backward()
        units = {u.fqn: u for u in impl.units(model)}
        assert {"a", "b"} <= set(units), f"expected units 'a' and 'b', got {sorted(units)}"
        for fqn, want_grad in (("a", True), ("b", False)):
            unit = units[fqn]
            assert unit.local_grads, f"step {step}: unit {fqn!r} reports no local shards"
            have = [g is not None for g in unit.held_grads()]  # an empty shard's says nothing (UnitInfo)
            assert have == [want_grad] * len(have), (
                f"step {step}, rank {ctx.rank}: unit {fqn!r} grad present {have}, expected all {want_grad}"
            )
