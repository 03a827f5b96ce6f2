"""hybrid_shard: shard within a node, replicate across nodes.

[Note: hybrid layout on CPU]
Every case here runs on nodes of ranks: by default 4 ranks laid out as 2 "nodes" of 2 ranks,

    shard (intra-node) groups      [0, 1]  [2, 3]
    replicate (inter-node) groups  [0, 2]  [1, 3]

and at any even world size from 4: process and thread ranks in nodes of 2
(``--world-size 8``: 4 nodes of 2), a launched job in its own nodes
(``LOCAL_WORLD_SIZE``; 2 agents of 4 ranks: shard groups [0..3] [4..7],
replicate groups [0, 4] ... [3, 7]). The expected groups, collectives and
baselines follow the layout (``node_layout``); each row reports its mesh.

Cases build this layout explicitly (a ``(shard, replicate)`` group tuple, or
a 2-D ``(replicate, shard)`` device mesh) except ``basic_setup`` with
``use_device_mesh=False``, where the implementation must derive it itself
from the ranks on its node. On an accelerator host that is the seed's
contract, the node's devices (one node of 4 GPUs: one shard group of 4,
replicate groups of 1). On the CPU the node size is what a launcher such as
torchrun reports, ``LOCAL_WORLD_SIZE``, which the case sets to the layout's
node size on every rank (2, or a launched job's own); an implementation that
sizes nodes some other way (e.g. by counting accelerators where there are
none) builds other groups and fails the group check, which is the point of
the check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import Scalable, case
from conformance.contract.exposures import parameter_exposures, under_exposure
from conformance.contract.messages import INVALID_PG_ERROR, MANUAL_WRAP_ERROR
from conformance.contract.results import CaseReport
from fixtures.baselines import cached
from fixtures.hybrid_shard import (
    HYBRID,
    LAYERS,
    NODE,
    NODES,
    WORLD,
    Setup,
    build_hybrid_transformer,
    check_collectives,
    check_groups,
    check_reshard_after_forward,
    check_strategies,
    fwd_bwd,
    hybrid_groups,
    io,
    mesh_report,
    node_layout,
    node_size,
    ranks,
    resharded_while_computing,
    split_units,
)
from fixtures.models import ThreeLinear, TiedTransformer
from fixtures.optimizers import OPTIMIZERS, wrapped_optim
from fixtures.parity import (
    COPIED,
    assert_close_named,
    assert_close_seq,
    assert_close_tree,
    assert_same_across_ranks,
)
from fixtures.rank_settings import env_on_all_ranks
from fixtures.seeding import generator, rank_seed

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["NODE", "WORLD", "Setup", "build_hybrid_transformer", "fwd_bwd"]  # the trace golden's imports

STEPS = 5  # training steps of parity_with_fsdp


# -- manual wrapping and group validation -------------------------------------------------
@case(
    "hybrid_shard/manual_wrap_requires_pg", clause="C7",
    world_size=Scalable(default=WORLD, minimum=2),
    requires=[Capability.HYBRID_MANUAL_WRAP_CHECK],
)
@pytest.mark.parametrize("strategy", HYBRID)
def test_manual_wrap_requires_pg(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
    """Wrapping with a hybrid strategy and neither a process group nor a device mesh raises a ValueError
    saying it "requires explicit specification of process group or device_mesh."."""
    with pytest.raises(ValueError, match=re.escape(MANUAL_WRAP_ERROR)):
        impl.wrap(ThreeLinear(seed=0), WrapSpec(strategy=strategy))


@case(
    "hybrid_shard/invalid_pg_specification", clause="C7",
    world_size=Scalable(default=WORLD, minimum=2),
    requires=[Capability.HYBRID_PG_VALIDATION],
    strategies=["HYBRID_SHARD"],
)
def test_invalid_pg_specification(ctx: RankContext, impl: FSDPAdapter) -> None:
    """HYBRID_SHARD given one process group (the world's) instead of a (shard, replicate) pair or a mesh,
    with auto-wrapping, raises a ValueError "Expected process_group to be passed in..."."""
    spec = WrapSpec(
        strategy="HYBRID_SHARD", auto_wrap=AutoWrap((nn.Linear,)), process_group=ctx.group
    )
    with pytest.raises(ValueError, match=INVALID_PG_ERROR):
        impl.wrap(ThreeLinear(seed=0), spec)


# -- basic setup: groups and communication pattern ----------------------------------------
def _setup_requires(params: Mapping[str, Any]) -> list[Capability]:
    """A mesh or node-local groups; MIXED_HYBRID_FULL nests a hybrid wrap under a FULL_SHARD one, unit specs a
    plan does not carry, so it also needs manual nesting."""
    nesting = [Capability.MANUAL_NESTING] if params["mode"] == "MIXED_HYBRID_FULL" else []
    return [Capability.DEVICE_MESH if params["use_device_mesh"] else Capability.HYBRID_AUTO_GROUPS, *nesting]


@case("hybrid_shard/basic_setup", world_size=NODES, requires=_setup_requires, uses=[Capability.FLAT_PARAM],
      clause="C15")
@pytest.mark.parametrize("use_device_mesh", [False, True])
@pytest.mark.parametrize("mode", ["ALL_HYBRID", "MIXED_HYBRID_FULL"])
@pytest.mark.parametrize("strategy", HYBRID)
def test_basic_setup(ctx: RankContext, impl: FSDPAdapter, strategy: str, mode: str,
                     use_device_mesh: bool) -> CaseReport:
    """Each unit reports its strategy (hybrid or FULL_SHARD by ``mode``), hybrid units shard within a node
    and replicate across nodes, non-root hybrid units are resharded after forward iff HYBRID_SHARD, and in
    one forward/backward every collective is over the expected group, with at least one all-gather per unit
    in forward, one reduce-scatter per unit and one replicate all-reduce per hybrid unit in backward, and
    backward all-gathers that show HYBRID_SHARD re-gathering and _HYBRID_SHARD_ZERO2 not (per unit or per
    parameter alike: ``check_collectives``). For every parameter exposure the implementation offers."""
    node = node_layout(ctx)[1] if use_device_mesh else node_size(ctx)
    for use_orig_params in parameter_exposures(impl):
        with under_exposure(use_orig_params):
            _basic_setup(ctx, impl, Setup(strategy, mode, use_orig_params, use_device_mesh), node)
    return mesh_report(ctx, node)


def _basic_setup(ctx: RankContext, impl: FSDPAdapter, setup: Setup, node: int) -> None:
    with env_on_all_ranks(ctx, "LOCAL_WORLD_SIZE", str(node)):
        model = build_hybrid_transformer(ctx, impl, setup)
    hybrid, full = split_units(ctx, impl.units(model), setup.mode)
    check_strategies(hybrid, full, setup.strategy)
    groups = check_groups(ctx, hybrid, node)
    inputs = io().get_input(ctx.device, generator(rank_seed(0, ctx.rank)))
    with ctx.record_collectives() as forward, resharded_while_computing(impl, model) as computing:
        output = model(*inputs)
        check_reshard_after_forward(impl, model, setup.strategy, computing)
    with ctx.record_collectives() as backward:
        io().get_loss(inputs, output).backward()
    check_collectives(ctx, forward, backward, hybrid, full, setup.strategy, groups)


# -- training parity with FULL_SHARD -------------------------------------------------------
@case("hybrid_shard/parity_with_fsdp", world_size=NODES, requires=[Capability.HYBRID_VIA_PG_TUPLE],
      clause=("C15", "C1"),
      uses=[Capability.FLAT_PARAM])
@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("strategy", HYBRID)
def test_parity_with_fsdp(ctx: RankContext, impl: FSDPAdapter, strategy: str, optim: str) -> CaseReport:
    """The seed's transformer (tied embedding/output weights, encoder and decoder layers
    as units): hybrid units replicate over more than one rank, and 5 steps of HSDP give FULL_SHARD's
    losses. Adam as in the seed, and SGD with momentum, which a wrong gradient scale on the replicate
    reduction changes. For every parameter exposure the implementation offers."""
    for use_orig_params in parameter_exposures(impl):
        with under_exposure(use_orig_params):
            _parity_with_fsdp(ctx, impl, strategy, use_orig_params, optim)
    return mesh_report(ctx)


def _parity_with_fsdp(ctx: RankContext, impl: FSDPAdapter, strategy: str, use_orig_params: bool, optim: str) -> None:
    hybrid_model = impl.wrap(
        TiedTransformer(seed=0).to(ctx.device),
        WrapSpec(strategy=strategy, auto_wrap=LAYERS, process_group=hybrid_groups(ctx),
                 use_orig_params=use_orig_params),
    )
    replicate = [u.replicate_group for u in impl.units(hybrid_model) if u.local_shards]
    assert replicate and all(len(ranks(g)) > 1 for g in replicate), (
        f"hybrid units replicate over {[ranks(g) for g in replicate]}: no replication"
    )
    # Both hybrid strategies are held to the same FULL_SHARD run: computed once ([Note: baseline cache]).
    full_losses = cached(
        "full-shard-losses",
        {"impl": impl.name, "model": TiedTransformer, "seed": 0, "auto_wrap": LAYERS, "optim": optim,
         "use_orig_params": use_orig_params, "steps": STEPS, "inputs": "get_input(rank_seed(1, rank))",
         "rank": ctx.rank, "world": ctx.world_size, "device": ctx.device},
        lambda: _train_losses(ctx, impl, impl.wrap(TiedTransformer(seed=0).to(ctx.device), WrapSpec(
            strategy="FULL_SHARD", auto_wrap=LAYERS, use_orig_params=use_orig_params)), optim),
        group=None,
    )
    hybrid_losses = _train_losses(ctx, impl, hybrid_model, optim)
    for step, (got, want) in enumerate(zip(hybrid_losses, full_losses, strict=True)):
        # Not bit-exact, by construction: FULL_SHARD reduce-scatters the four ranks'
        # gradients in one sum, hybrid sums pairs within a node and then the two
        # pair sums across nodes, a different association of float additions. So
        # the comparison is the seed's: default float32 tolerances.
        assert_close_seq([got], [want], what=f"rank {ctx.rank} step {step}: {strategy} vs FULL_SHARD loss ({optim})")


def _train_losses(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, optim: str) -> list[torch.Tensor]:
    """``STEPS`` steps of ``model`` on this rank's inputs (the seed's sum loss); the loss of each step."""
    opt = wrapped_optim(impl, model, optim)
    gen = generator(rank_seed(1, ctx.rank))
    losses = []
    for _ in range(STEPS):
        inputs = io().get_input(ctx.device, gen)
        opt.zero_grad()
        loss = model(*inputs).sum()
        loss.backward()
        optional.step(impl, model, opt)
        losses.append(loss.detach())
    return losses


# -- state dicts and module-state sync ------------------------------------------------------
def _hybrid_three_linear(
    ctx: RankContext, impl: FSDPAdapter, seed: int, groups: Any, **spec: Any
) -> nn.Module:
    return impl.wrap(
        ThreeLinear(seed=seed).to(ctx.device),
        WrapSpec(strategy="HYBRID_SHARD", process_group=groups, use_orig_params=True, **spec),
    )


def _check_groups_used_as_given(impl: FSDPAdapter, model: nn.Module, groups: tuple[Any, Any]) -> None:
    """Units shard and replicate over the very group objects passed in, not look-alikes."""
    owning = [u for u in impl.units(model) if u.local_shards]
    assert owning, "no unit owns parameters"
    for unit in owning:
        assert unit.shard_group is groups[0] and unit.replicate_group is groups[1], (
            f"unit {unit.fqn!r} uses groups with ranks ({ranks(unit.shard_group)}, "
            f"{ranks(unit.replicate_group)}) that are not the (shard, replicate) objects given, "
            f"ranks ({ranks(groups[0])}, {ranks(groups[1])})"
        )


@case("hybrid_shard/sharded_state_dict_roundtrip", clause=("C15", "C4"), world_size=NODES,
      strategies=["HYBRID_SHARD"],
      requires=[Capability.HYBRID_VIA_PG_TUPLE, Capability.SHARDED_STATE_DICT, Capability.OPTIM_STATE_DICT])
def test_sharded_state_dict_roundtrip(ctx: RankContext, impl: FSDPAdapter) -> CaseReport:
    """Units shard and replicate over the very (shard, replicate) group objects passed in; after one AdamW
    step, the sharded model and optimizer state dicts loaded into a differently seeded hybrid model give
    it the trained full params and local optimizer state, exactly."""
    groups = hybrid_groups(ctx)
    model = _hybrid_three_linear(ctx, impl, 0, groups)
    _check_groups_used_as_given(impl, model, groups)
    optim = optional.optimizer(impl, model, torch.optim.AdamW)
    (inp,) = ThreeLinear().get_input(ctx.device, generator(rank_seed(2, ctx.rank)))
    model(inp).sum().backward()
    optional.step(impl, model, optim)
    model_state = impl.sharded_state_dict(model)
    optim_state = impl.optim_state_dict(model, optim, sharded=True)

    fresh = _hybrid_three_linear(ctx, impl, 1, groups)
    fresh_optim = optional.optimizer(impl, fresh, torch.optim.AdamW)
    before = impl.full_params(fresh)
    assert any(not torch.equal(before[k], v) for k, v in impl.full_params(model).items()), (
        "the fresh model already equals the trained one; the round trip would prove nothing"
    )
    impl.load_state_dict(fresh, model_state, sharded=True)
    impl.load_optim_state_dict(fresh, fresh_optim, optim_state, sharded=True)
    assert_close_named(
        impl.full_params(fresh),
        impl.full_params(model),
        what=f"rank {ctx.rank}: params after sharded load",
        exact=COPIED,
    )
    assert_close_tree(
        fresh_optim.state_dict()["state"],
        optim.state_dict()["state"],
        what=f"rank {ctx.rank}: local optimizer state after sharded load",
        exact=COPIED,
    )
    return mesh_report(ctx)


@case(
    "hybrid_shard/sync_module_states", clause=("C15", "C6"),
    world_size=NODES,
    requires=[Capability.HYBRID_VIA_PG_TUPLE, Capability.SYNC_MODULE_STATES],
    strategies=["HYBRID_SHARD"],
)
def test_sync_module_states(ctx: RankContext, impl: FSDPAdapter) -> CaseReport:
    """HYBRID_SHARD with ``sync_module_states=True`` over (shard, replicate) groups makes every rank's full
    params rank 0's: weights rank 0 filled with zeros, biases equal to rank 0's before wrapping."""
    module = ThreeLinear(seed=rank_seed(3, ctx.rank)).to(ctx.device)
    with torch.no_grad():
        for linear in (module.lin1, module.lin2, module.lin3):
            linear.weight.fill_(float(ctx.rank))
    rank0_biases = ctx.all_gather_object(
        {n: p.detach().cpu() for n, p in module.named_parameters() if n.endswith("bias")}
    )[0]
    model = impl.wrap(
        module,
        WrapSpec(
            strategy="HYBRID_SHARD",
            process_group=hybrid_groups(ctx),
            use_orig_params=True,
            sync_module_states=True,
        ),
    )
    params = impl.full_params(model)
    assert_same_across_ranks(params, what="full params after sync_module_states")
    for name in ("lin1.weight", "lin2.weight", "lin3.weight"):
        assert bool((params[name] == 0).all()), (
            f"rank {ctx.rank}: {name} is not rank 0's zeros: {params[name]}"
        )
    assert_close_named(
        {n: p for n, p in params.items() if n.endswith("bias")},
        rank0_biases,
        what=f"rank {ctx.rank}: biases vs rank 0's before wrapping",
        exact=COPIED,
    )
    return mesh_report(ctx)
