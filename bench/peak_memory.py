"""Peak unsharded parameter bytes held at once, per rank, against the bound.

Every leaf module's forward (pre and post) and backward hook samples which
units are currently unsharded (through the adapter's ``units()``
introspection) and adds up their full (padded) flat-parameter bytes. The
bound for a flat-parameter FSDP with ``limit_all_gathers`` is: the root unit
(kept unsharded from forward to backward) plus ``1 + inflight`` of the largest
other units, where ``inflight`` is the number of prefetched all-gathers the
implementation allows (2 for the reference, see [Note: limit_all_gathers] in
``fsdp_impl/unit.py``). Sharded parameters (``padded / shard size`` per unit)
are always held and reported alongside.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import harness
from bench._common import base_parser, print_table, write_json
from bench.step_time import EncoderStack
from conformance.contract import registry
from conformance.contract.adapter import AutoWrap, WrapSpec
from fixtures.seeding import generator

__all__ = ["measure_peak", "INFLIGHT"]

#: Prefetched all-gathers the reference allows ahead of compute with limit_all_gathers=True.
INFLIGHT = 2


def _unit_bytes(unit: Any) -> int:
    shard = unit.local_shards[0]
    size = torch.distributed.get_world_size(unit.shard_group) if unit.shard_group is not None else 1
    return shard.numel() * size * shard.element_size()


def measure_peak(ctx: Any, impl_name: str, prefetch: bool, layers: int = 4, d_model: int = 64) -> dict[str, int]:
    impl = registry.load(impl_name)
    spec = WrapSpec(strategy="FULL_SHARD", auto_wrap=AutoWrap((nn.TransformerEncoderLayer,)),
                    forward_prefetch=prefetch, backward_prefetch="BACKWARD_PRE" if prefetch else None)
    model = impl.wrap(EncoderStack(d_model, layers), spec)
    x = torch.randn(4, 8, d_model, generator=generator(ctx.rank))
    model(x).sum().backward()  # lazy init and the recorded order for prefetching
    units = [u for u in impl.units(model) if u.local_shards]
    sizes = {id(u.module): _unit_bytes(u) for u in units}
    peak = 0

    def sample(*_: Any) -> None:
        nonlocal peak
        current = sum(sizes[id(u.module)] for u in impl.units(model) if u.local_shards and not u.resharded)
        peak = max(peak, current)

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_pre_hook(sample) for m in leaves]
    handles += [m.register_forward_hook(sample) for m in leaves]
    handles += [m.register_full_backward_hook(sample) for m in leaves if list(m.parameters())]
    model(x).sum().backward()
    for h in handles:
        h.remove()
    root_bytes = sizes[id(units[0].module)] if units and units[0].module is model else 0
    largest = max((b for key, b in sizes.items() if key != id(model)), default=0)
    shard = sum(u.local_shards[0].numel() * u.local_shards[0].element_size() for u in units)
    return {"peak_unsharded": peak, "bound": root_bytes + (1 + INFLIGHT) * largest, "sharded": shard,
            "all_unsharded": sum(sizes.values())}


def main() -> None:
    parser = base_parser("peak_memory", __doc__)
    parser.add_argument("--impl", action="append", default=None, help="default: reference and torch-fsdp1")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    rows, payload = [], {}
    try:
        for impl in args.impl or ["reference", "torch-fsdp1"]:
            for prefetch in (False, True):
                per_rank = harness.run(measure_peak, world_size=2, mode="thread", args=(impl, prefetch, args.layers))
                payload[f"{impl} prefetch={prefetch}"] = per_rank
                for rank, r in enumerate(per_rank):
                    rows.append([impl, prefetch, rank, r["peak_unsharded"], r["bound"], r["all_unsharded"],
                                 r["sharded"], "yes" if r["peak_unsharded"] <= r["bound"] else "NO"])
    finally:
        harness.shutdown_pools()
    print_table(["impl", "prefetch", "rank", "peak unsharded B", "bound B", "whole model B", "sharded B",
                 "<= bound"], rows)
    write_json(args.json, {"layers": args.layers, "results": payload})


if __name__ == "__main__":
    main()
