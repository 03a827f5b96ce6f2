"""Communication per training step, by collective and group, next to the theoretical minimum.

For each strategy the model (an MLP stack, one unit per layer plus a root unit
holding the head) trains one warm-up step, then one recorded step
(forward + backward). The recorder ([Note: collective patching]) counts calls
and input bytes per (op, group). The theoretical minimum for a flat-parameter
FSDP, per unit with parameters, ``S`` = shard size, ``P`` = padded numel:

=====================  ===============================================  =========================
strategy               all-gather (input = shard, P/S elements)          reduction
=====================  ===============================================  =========================
FULL_SHARD             forward each unit; backward each non-root unit   reduce-scatter P (shard)
SHARD_GRAD_OP          forward each unit                                reduce-scatter P (shard)
NO_SHARD               none                                             all-reduce P (world)
HYBRID_SHARD           as FULL_SHARD, on the shard group                + all-reduce P/S (replicate)
_HYBRID_SHARD_ZERO2    as SHARD_GRAD_OP, on the shard group             + all-reduce P/S (replicate)
=====================  ===============================================  =========================

The root unit keeps its parameters between forward and backward (as torch's
FSDP1 does), so it is not re-gathered. Measured on ``--impl`` (default
reference); other implementations are shown for comparison, not judged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn as nn

import harness
from bench._common import base_parser, print_table, write_json
from conformance.contract import registry
from conformance.contract.adapter import HYBRID_STRATEGIES, STRATEGIES, AutoWrap, WrapSpec
from fixtures.seeding import generator, seeded_init_

__all__ = ["measure_step", "theory", "Stack"]

Key = tuple[str, tuple[int, ...]]


class Block(nn.Linear):
    """A layer that becomes its own unit (the head is a plain Linear and stays in the root)."""


class Stack(nn.Module):
    """``depth`` odd-sized linear layers (padding matters) and a head owned by the root unit."""

    def __init__(self, dim: int = 17, depth: int = 3, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, 3)
        seeded_init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _spec(ctx: Any, strategy: str) -> WrapSpec:
    pg: Any = None
    if strategy in HYBRID_STRATEGIES:
        half = ctx.world_size // 2
        shard_groups = [ctx.new_group(list(range(i * half, (i + 1) * half))) for i in range(2)]
        replicate_groups = [ctx.new_group([r, r + half]) for r in range(half)]
        pg = (shard_groups[ctx.rank // half], replicate_groups[ctx.rank % half])
    return WrapSpec(strategy=strategy, auto_wrap=AutoWrap((Block,)), process_group=pg)


def measure_step(ctx: Any, impl_name: str, strategy: str) -> dict[str, Any]:
    """One recorded training step on this rank: measured and theoretical (calls, bytes) per key."""
    impl = registry.load(impl_name)
    model = impl.wrap(Stack(), _spec(ctx, strategy))
    x = torch.randn(4, 17, generator=generator(ctx.rank))
    model(x).sum().backward()  # warm-up: lazy init happens outside the recorded step
    with ctx.record_collectives() as trace:
        model(x).sum().backward()
    measured: Counter[Key] = Counter()
    measured_bytes: Counter[Key] = Counter()
    for call in trace.calls:
        measured[(call.op, call.group_ranks)] += 1
        measured_bytes[(call.op, call.group_ranks)] += call.bytes
    expected_calls, expected_bytes = theory(impl, model, strategy)
    return {
        "measured": {_name(k): [measured[k], measured_bytes[k]] for k in measured},
        "theory": {_name(k): [expected_calls[k], expected_bytes[k]] for k in expected_calls},
    }


def _name(key: Key) -> str:
    return f"{key[0]} {list(key[1])}"


def theory(impl: Any, model: nn.Module, strategy: str) -> tuple[Counter[Key], Counter[Key]]:
    """Minimum calls and input bytes per (op, group) for one step (see the module docstring)."""
    import torch.distributed as dist

    calls: Counter[Key] = Counter()
    nbytes: Counter[Key] = Counter()
    world = tuple(range(dist.get_world_size()))
    for position, unit in enumerate(impl.units(model)):
        if not unit.local_shards:
            continue
        elem = unit.local_shards[0].element_size()
        shard = unit.local_shards[0].numel()
        size = dist.get_world_size(unit.shard_group) if unit.shard_group is not None else 1
        padded = shard * (1 if strategy == "NO_SHARD" else size)
        if strategy == "NO_SHARD":
            _add(calls, nbytes, ("all_reduce", world), padded * elem)
            continue
        group = tuple(dist.get_process_group_ranks(unit.shard_group))
        gathers = 1 if strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") or position == 0 else 2
        for _ in range(gathers):
            _add(calls, nbytes, ("all_gather_into_tensor", group), shard * elem)
        _add(calls, nbytes, ("reduce_scatter_tensor", group), padded * elem)
        if strategy in HYBRID_STRATEGIES:
            replicate = tuple(dist.get_process_group_ranks(unit.replicate_group))
            _add(calls, nbytes, ("all_reduce", replicate), shard * elem)
    return calls, nbytes


def _add(calls: Counter[Key], nbytes: Counter[Key], key: Key, size: int) -> None:
    calls[key] += 1
    nbytes[key] += size


def run(impl_name: str) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for strategy in STRATEGIES:
        world_size = 4 if strategy in HYBRID_STRATEGIES else 2
        out[strategy] = harness.run(measure_step, world_size=world_size, mode="process",
                                    args=(impl_name, strategy), timeout_s=120)
    return out


def main() -> None:
    parser = base_parser("comm_volume", __doc__)
    parser.add_argument("--impl", default="reference")
    args = parser.parse_args()
    results = run(args.impl)
    rows = []
    for strategy, per_rank in results.items():
        rank0 = per_rank[0]
        for key in sorted(set(rank0["measured"]) | set(rank0["theory"])):
            got = rank0["measured"].get(key, [0, 0])
            want = rank0["theory"].get(key, [0, 0])
            rows.append([strategy, key, got[0], want[0], got[1], want[1], "yes" if got == want else "NO"])
    print(f"implementation: {args.impl} (rank 0; process ranks, gloo)")
    print_table(["strategy", "op [group]", "calls", "min calls", "bytes", "min bytes", "= theory"], rows)
    write_json(args.json, {"impl": args.impl, "results": results})


if __name__ == "__main__":
    main()
