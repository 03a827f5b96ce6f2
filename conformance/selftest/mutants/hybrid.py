"""Hybrid-sharding mutants: strategies, given groups, and the replicate reduction."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from conformance.contract.adapter import UnitInfo, WrapSpec
from conformance.selftest.declare import Expect, _Mutant, _state_of

__all__ = ["Zero2AsHybridShard", "RegroupsGivenGroups", "HybridDividesByShardOnly", "RootNotReplicated",
           "ReportsAlwaysResharded"]


class Zero2AsHybridShard(_Mutant):
    """Treats ``_HYBRID_SHARD_ZERO2`` as ``HYBRID_SHARD`` (parameters freed after forward)."""

    name = "mutant-zero2-as-hybrid-shard"
    breaks = "_HYBRID_SHARD_ZERO2 keeping parameters unsharded between forward and backward"
    expect = Expect("basic_setup and _HYBRID_SHARD_ZERO2", "thread", ("hybrid_shard/basic_setup",))

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        return replace(spec, strategy="HYBRID_SHARD") if spec.strategy == "_HYBRID_SHARD_ZERO2" else spec


class RegroupsGivenGroups(_Mutant):
    """Builds new groups with the same ranks instead of using a given ``(shard, replicate)`` tuple."""

    name = "mutant-regroups-given-groups"
    breaks = "using an explicit (shard, replicate) group tuple as given"
    expect = Expect("sharded_state_dict_roundtrip", "thread", ("hybrid_shard/sharded_state_dict_roundtrip",))

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        if not (spec.is_hybrid and isinstance(spec.process_group, tuple)):
            return spec
        shard, _replicate = spec.process_group
        size, world, rank = dist.get_world_size(shard), dist.get_world_size(), dist.get_rank()
        # Every rank creates every group in the same order, as new_group requires.
        blocks = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
        strides = [dist.new_group(list(range(o, world, size))) for o in range(size)]
        return replace(spec, process_group=(blocks[rank // size], strides[rank % size]))


class HybridDividesByShardOnly(_Mutant):
    """Hybrid units divide reduced gradients by the shard group's size, not shard x replicate."""

    name = "mutant-hybrid-divides-by-shard-only"
    breaks = "averaging hybrid gradients over the replicas"
    # Adam barely notices a uniform gradient scale; SGD with momentum does.
    expect = Expect(
        "(parity_with_fsdp or cpu_training_parity_vs_ddp) and HYBRID_SHARD and SGD", "thread",
        ("hybrid_shard/parity_with_fsdp[optim=SGD]", "training/cpu_training_parity_vs_ddp[optim=SGD]"),
    )

    def _mutate_unit(self, unit: Any) -> None:
        groups = _state_of(unit).groups
        if groups.inter_node_pg is not None:
            groups.dp_world_size = groups.shard_size


class RootNotReplicated(_Mutant):
    """A hybrid root unit skips the replicate all-reduce of its own parameters' gradients."""

    name = "mutant-root-not-replicated"
    breaks = "all-reducing the root unit's gradients across replicas"
    # The transformer's root owns the tied embedding; a model whose root owns nothing cannot see this.
    expect = Expect("parity_with_fsdp", "thread", ("hybrid_shard/parity_with_fsdp",))

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        model = super().wrap(module, spec)
        groups = _state_of(model).groups
        if groups.inter_node_pg is not None:
            groups.replicate_group = None
        return model


class ReportsAlwaysResharded(_Mutant):
    """Reports every unit resharded (``UnitInfo.resharded`` True wherever it reports one), whatever it holds."""

    name = "mutant-reports-always-resharded"
    breaks = "reporting the resharded state a unit is in rather than a constant"
    expect = Expect("basic_setup and not _HYBRID_SHARD_ZERO2", "thread",
                    ("hybrid_shard/basic_setup[strategy=HYBRID_SHARD]",))

    def units(self, model: nn.Module) -> list[UnitInfo]:
        return [u if u.resharded is None else replace(u, resharded=True) for u in super().units(model)]
