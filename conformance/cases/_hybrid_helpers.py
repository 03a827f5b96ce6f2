"""Layout, model and checks shared by the hybrid_shard cases (not a case module).

See [Note: hybrid layout on CPU] in ``test_hybrid_shard``.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conformance.contract.adapter import AutoWrap, FSDPAdapter, UnitInfo, WrapSpec
from conformance.contract.results import CaseReport
from conformance.contract.world_size import Scalable
from fixtures.meshes import SIMULATED_NODE, hybrid_ranks, ranks_per_node
from fixtures.meshes import hybrid_groups as mesh_groups
from fixtures.models import TiedTransformer
from fixtures.seeding import generator, rank_seed
from harness.rank_mode import RankMode

if TYPE_CHECKING:
    from harness import RankContext

WORLD = 4  # the default world: 2 simulated nodes of NODE ranks
NODE = SIMULATED_NODE  # ranks per node of process and thread ranks; see [Note: hybrid layout on CPU]
#: Several nodes of NODE ranks: 4 by default, any even size from 4 (a launched job: its own nodes).
NODES = Scalable(default=WORLD, minimum=2 * NODE, multiple_of=NODE)
HYBRID = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
LAYERS = AutoWrap((nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))


def node_layout(ctx: RankContext) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of the run ([Note: hybrid layout]): the replicate and shard sizes.

    A hybrid case needs replication and sharding both: a launched job of one node, or of nodes of one
    rank, is skipped naming its layout (the world size alone is not the reason)."""
    node = ranks_per_node(ctx)
    nodes = ctx.world_size // node
    if nodes < 2 or node < 2:
        pytest.skip(f"needs 2 nodes or more of 2 ranks or more (shard within a node, replicate across nodes); "
                    f"the launched job is {nodes} node(s) of {node} rank(s)")
    return nodes, node


def mesh_report(ctx: RankContext, node: int | None = None) -> CaseReport:
    """The row's mesh, for the report: ``replicas x shards`` with ``node`` ranks per shard group (by default
    the layout's), replicating across nodes."""
    node = node_layout(ctx)[1] if node is None else node
    nodes = ctx.world_size // node
    where = "launched agents" if ctx.mode is RankMode.LAUNCHED else "nodes"
    return CaseReport(reason=f"mesh {nodes} replica{'s' * (nodes > 1)} x {node} shard{'s' * (node > 1)} (shard "
                             f"within a node, replicate across {nodes} {where})",
                      metrics={"mesh_replicas": nodes, "mesh_shards": node})


def expected_groups(ctx: RankContext, node: int) -> tuple[list[int], list[int]]:
    """``(shard ranks, replicate ranks)`` of this rank with ``node`` ranks per node ([Note: hybrid layout])."""
    return hybrid_ranks(ctx.rank, ctx.world_size, node)


def hybrid_groups(ctx: RankContext) -> tuple[Any, Any]:
    """This rank's ``(shard, replicate)`` groups, one node's ranks per shard group ([Note: hybrid layout])."""
    return mesh_groups(ctx, node_layout(ctx)[1])


def ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (``[]`` for ``None``)."""
    return [] if group is None else dist.get_process_group_ranks(group)


@dataclass(frozen=True)
class Setup:
    """One ``basic_setup`` grid point."""

    strategy: str
    mode: (
        str  # ALL_HYBRID: every unit hybrid; MIXED_HYBRID_FULL: hybrid transformer, FULL_SHARD root
    )
    use_orig_params: bool
    use_device_mesh: bool


def build_hybrid_transformer(ctx: RankContext, impl: FSDPAdapter, setup: Setup) -> nn.Module:
    """Encoder/decoder layers are units; the rest is hybrid or FULL_SHARD by ``mode``."""
    mesh = (
        ctx.device_mesh(node_layout(ctx), ("replicate", "shard"))
        if setup.use_device_mesh
        else None
    )
    hybrid = WrapSpec(
        strategy=setup.strategy,
        auto_wrap=LAYERS,
        device_mesh=mesh,
        use_orig_params=setup.use_orig_params,
    )
    model = TiedTransformer(seed=0).to(ctx.device)
    if setup.mode == "ALL_HYBRID":
        return impl.wrap(model, hybrid)
    model.transformer = impl.wrap(model.transformer, hybrid)  # type: ignore[assignment]  # HYBRID_SUBTREE
    return impl.wrap(model, WrapSpec(strategy="FULL_SHARD", use_orig_params=setup.use_orig_params))


HYBRID_SUBTREE = "transformer"  # what MIXED_HYBRID_FULL wraps hybrid (build_hybrid_transformer)


@functools.cache
def io() -> TiedTransformer:
    """An unwrapped instance whose ``get_input`` / ``get_loss`` every case shares."""
    return TiedTransformer(seed=0)


def fwd_bwd(ctx: RankContext, model: nn.Module) -> None:
    """One forward/backward on this rank's batch."""
    inputs = io().get_input(ctx.device, generator(rank_seed(0, ctx.rank)))
    io().get_loss(inputs, model(*inputs)).backward()


def node_size(ctx: RankContext) -> int:
    """Ranks per node for automatic groups: the node's accelerators when spawned ranks compute on
    them (the seed's contract), else the layout's node (a launched job's own ``LOCAL_WORLD_SIZE``,
    else :data:`NODE`, reported as a launcher would: [Note: hybrid layout on CPU])."""
    if ctx.device.type == "cuda" and ctx.mode is not RankMode.LAUNCHED:
        return torch.cuda.device_count()
    return node_layout(ctx)[1]


def split_units(
    ctx: RankContext, units: list[UnitInfo], mode: str
) -> tuple[list[UnitInfo], list[UnitInfo]]:
    """``(hybrid, full-shard)`` units owning parameters, each checked against ``mode``."""
    owning = [u for u in units if u.local_shards]
    hybrid = [u for u in owning if u.replicate_group is not None]
    full = [u for u in owning if u.replicate_group is None]
    if mode == "ALL_HYBRID":
        assert not full, (
            f"ALL_HYBRID: units {[u.fqn for u in full]} are not hybrid (no replicate group; "
            f"shard groups {[ranks(u.shard_group) for u in full]})"
        )
    else:
        _check_full_outside_hybrid(hybrid, full, ctx.world_size)
    assert hybrid, f"{mode}: no hybrid unit owns parameters; units {[u.fqn for u in units]}"
    return hybrid, full


def _check_full_outside_hybrid(hybrid: list[UnitInfo], full: list[UnitInfo], world: int) -> None:
    """MIXED_HYBRID_FULL: everything under ``transformer`` (wrapped hybrid) is hybrid, and the parameters
    outside it are sharded over the whole world.

    FSDP1-like designs hold the outside parameters in the root unit; a per-parameter design may hold them
    in one unit per module (the embedding, the output projection). Either way some unit owning parameters
    shards over the world, every such unit does, and it lies outside the hybrid subtree; every hybrid
    unit lies inside it."""
    def under(fqn: str) -> bool:
        return fqn == HYBRID_SUBTREE or fqn.startswith(HYBRID_SUBTREE + ".")

    assert full, f"MIXED_HYBRID_FULL: no unit owning parameters shards over the world; hybrid {[u.fqn for u in hybrid]}"
    for unit in full:
        assert ranks(unit.shard_group) == list(range(world)), (
            f"FULL_SHARD unit {unit.fqn!r} shards over {ranks(unit.shard_group)}, "
            f"expected the world {list(range(world))}"
        )
    misplaced = [u.fqn for u in full if under(u.fqn)] + [u.fqn for u in hybrid if not under(u.fqn)]
    assert not misplaced, (
        f"MIXED_HYBRID_FULL: units {misplaced} are on the wrong side of {HYBRID_SUBTREE!r} "
        f"(full-shard {[u.fqn for u in full]}, hybrid {[u.fqn for u in hybrid]})"
    )


def check_strategies(hybrid: list[UnitInfo], full: list[UnitInfo], strategy: str) -> None:
    """Each unit reports its own strategy (where the implementation has one per unit)."""
    want = {u.fqn: strategy for u in hybrid} | {u.fqn: "FULL_SHARD" for u in full}
    got = {u.fqn: u.strategy for u in (*hybrid, *full)}
    wrong = {fqn: s for fqn, s in got.items() if s is not None and s != want[fqn]}
    assert not wrong, f"unit strategies {wrong}, expected {want}"


def check_groups(ctx: RankContext, hybrid: list[UnitInfo], node: int) -> tuple[list[int], list[int]]:
    want_shard, want_replicate = expected_groups(ctx, node)
    for unit in hybrid:
        got = (ranks(unit.shard_group), ranks(unit.replicate_group))
        assert got == (want_shard, want_replicate), (
            f"rank {ctx.rank} unit {unit.fqn!r}: (shard, replicate) ranks {got}, "
            f"expected {(want_shard, want_replicate)} ({node} ranks per node)"
        )
    shard_ids = {id(u.shard_group) for u in hybrid}
    replicate_ids = {id(u.replicate_group) for u in hybrid}
    assert len(shard_ids) == 1 and len(replicate_ids) == 1, (
        f"hybrid units use {len(shard_ids)} shard and {len(replicate_ids)} replicate "
        "group objects; all units must share one of each"
    )
    return want_shard, want_replicate


def check_reshard_after_forward(impl: FSDPAdapter, model: nn.Module, strategy: str) -> None:
    """After forward, non-root hybrid units are resharded iff the strategy is HYBRID_SHARD
    (``_HYBRID_SHARD_ZERO2`` keeps them unsharded until backward)."""
    want = strategy == "HYBRID_SHARD"
    wrong = [
        (u.fqn, u.resharded)
        for u in impl.units(model)
        if u.fqn and u.local_shards and u.replicate_group is not None
        and u.resharded is not None and u.resharded != want
    ]
    assert not wrong, f"{strategy}: after forward (unit, resharded) {wrong}, expected resharded={want}"


#: Collective names as the recorder spells them -> the kind of collective counted.
KINDS = {
    "all_gather_into_tensor": "all-gather",
    "all_gather": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
}
Collectives = Counter[tuple[str, tuple[int, ...]]]


def counted(trace: Any) -> Collectives:
    """``(kind, group ranks) -> count`` of the recorded collectives of :data:`KINDS`."""
    return Counter((KINDS[c.op], c.group_ranks) for c in trace.calls if c.op in KINDS)


def check_collectives(
    ctx: RankContext, forward: Any, backward: Any, hybrid: list[UnitInfo], full: list[UnitInfo], strategy: str,
    groups: tuple[list[int], list[int]],
) -> None:
    """What one forward (``forward``) and backward (``backward``) of a fresh model communicate.

    No count is exact: an implementation may issue one collective per unit or one per parameter
    (or anything between), so each bound is per unit, "at least one" or "no more than":

    * groups: every all-gather and reduce-scatter is over a unit's shard group (the hybrid shard
      group; the world only for the FULL_SHARD units, i.e. the MIXED_HYBRID_FULL root), every
      all-reduce over the hybrid replicate group; nothing else, and nothing over another group;
    * forward: at least one all-gather per unit over its shard group;
    * backward: at least one reduce-scatter per unit over its shard group, and at least one
      all-reduce per hybrid unit over the replicate group;
    * backward all-gathers over the hybrid shard group: HYBRID_SHARD frees every non-root unit after
      forward, so at least one per non-root hybrid unit; _HYBRID_SHARD_ZERO2 keeps them unsharded,
      so only the root may gather again, which bounds them by forward's all-gathers there less one
      per non-root hybrid unit (what the root's own forward all-gathers can have been at most).
      The root may gather again under either strategy (FSDP1 keeps it, FSDP2 may free it).
    """
    shard, replicate = (tuple(g) for g in groups)
    world = tuple(range(ctx.world_size))
    fwd, bwd = counted(forward), counted(backward)
    allowed = {("all-gather", shard), ("reduce-scatter", shard), ("all-reduce", replicate)}
    if full:
        allowed |= {("all-gather", world), ("reduce-scatter", world)}
    stray = {key: n for key, n in (fwd + bwd).items() if key not in allowed}
    non_root = sum(1 for u in hybrid if u.fqn != "")
    at_least = {
        "forward all-gathers over the shard group": (fwd["all-gather", shard], len(hybrid)),
        "forward all-gathers over the world (FULL_SHARD units)": (fwd["all-gather", world], len(full)),
        "backward reduce-scatters over the shard group": (bwd["reduce-scatter", shard], len(hybrid)),
        "backward reduce-scatters over the world (FULL_SHARD units)": (bwd["reduce-scatter", world], len(full)),
        "backward all-reduces over the replicate group": (bwd["all-reduce", replicate], len(hybrid)),
    }
    regather = bwd["all-gather", shard]
    if strategy == "HYBRID_SHARD":
        at_least["backward all-gathers over the shard group (non-root units were freed)"] = (regather, non_root)
    short = {what: f"{got} < {want}" for what, (got, want) in at_least.items() if got < want}
    kept = fwd["all-gather", shard] - non_root
    over = strategy != "HYBRID_SHARD" and regather > kept
    assert not stray and not short and not over, (
        f"rank {ctx.rank} {strategy} ({len(hybrid)} hybrid units, {non_root} non-root; {len(full)} FULL_SHARD): "
        + "; ".join([*(f"{k} over {g}: {n} (not expected there)" for (k, g), n in stray.items()),
                     *(f"{what}: {why}" for what, why in short.items()),
                     *([f"backward all-gathers over the shard group: {regather} > {kept} (only the root may gather "
                        "again; non-root units kept their parameters)"] if over else [])])
        + f"\nforward:\n{forward.render()}\nbackward:\n{backward.render()}"
    )
