"""Mutants of the reference's ``fully_shard`` front door: resharding, prefetch lists, frozen, ignored
and shared parameters, meta-device materialization and assigned loads, the DTensors a checkpoint is made of, and the
``FSDPModule`` methods of ``fully_shard_api`` (divide-factor alias, partial reduction, all-reduce hook, reset)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = [
    "ReshardIntAsFalse",
    "PrefetchListReversed",
    "FrozenParamsTrained",
    "IgnoredParamsSharded",
    "SharedAcrossUnitsUnchecked",
    "MetaInitNotFollowed",
    "AssignedParamsNotAdopted",
    "ShardsClaimReplicated",
    "MisuseUnchecked",
    "GradSyncKeepsGradInParamDtype",
    "ReduceScatterDivideFactorIgnored",
    "PartialReductionDropped",
    "AllReduceHookIgnored",
    "ResetIterStateKeepsReductions",
]

Fn = Callable[..., Any]


def _int_as_false(setting: Fn) -> Fn:
    def reshard_setting(value: Any, groups: Any, mesh: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return False, None
        return setting(value, groups, mesh)

    return reshard_setting


class ReshardIntAsFalse(_Mutant):
    """``reshard_after_forward=<int>`` keeps the whole unsharded parameters, as ``False`` does."""

    name = "mutant-reshard-int-as-false"
    breaks = "reshard_after_forward as an int"
    expect = Expect("after_forward", "thread", ("reshard/after_forward[setting=2]",))
    patches = (Patch("fsdp_impl.composable:_reshard_setting", _int_as_false),)


def _reversed_lists(prefetch_next: Fn) -> Fn:
    def prefetch_next_reversed(unit: Any, state: Any, explicit: Any, recorded: Any) -> None:
        prefetch_next(unit, state, None if explicit is None else explicit[::-1], recorded)

    return prefetch_next_reversed


class PrefetchListReversed(_Mutant):
    """All-gathers the modules of a prefetch list in the reverse of the declared order."""

    name = "mutant-prefetch-list-reversed"
    breaks = "the order of explicit prefetch lists"
    expect = Expect("explicit_prefetch", "thread", ("reshard/explicit_prefetch",))
    patches = (Patch("fsdp_impl.unit:_prefetch_next", _reversed_lists),)


def _all_trainable(build: Fn) -> Fn:
    def build_handle(*args: Any) -> Any:
        handle = build(*args)
        for slot in handle.slots:
            slot.param.requires_grad_(True)
        return handle

    return build_handle


class FrozenParamsTrained(_Mutant):
    """Sharding makes every parameter require grad again, so frozen ones train."""

    name = "mutant-frozen-params-trained"
    breaks = "frozen parameters (requires_grad=False)"
    expect = Expect("test_frozen", "thread", ("param_kinds/frozen",))
    patches = (Patch("fsdp_impl.composable:_build_handle", _all_trainable),)


def _nothing_ignored(managed: Fn) -> Fn:
    def managed_all(module: Any, ignored_params: Any) -> Any:
        return managed(module, None)

    return managed_all


class IgnoredParamsSharded(_Mutant):
    """``ignored_params`` are sharded and reduced like every other parameter."""

    name = "mutant-ignored-params-sharded"
    breaks = "ignored parameters"
    expect = Expect("test_ignored", "thread", ("param_kinds/ignored",))
    patches = (Patch("fsdp_impl.composable:_managed", _nothing_ignored),)


class SharedAcrossUnitsUnchecked(_Mutant):
    """A parameter shared by two units is managed by both, each with its own copy, without a word."""

    name = "mutant-shared-across-units-unchecked"
    breaks = "refusing (or handling) a parameter shared across units"
    expect = Expect("test_shared and across_units", "thread", ("param_kinds/shared[position=across_units]",))
    patches = (Patch.instead("fsdp_impl.composable:_check_not_shared", lambda module, handle: None),)


class MetaInitNotFollowed(_Mutant):
    """After ``to_empty`` the unit keeps its old (meta) shard: what the user's reset writes is never gathered."""

    name = "mutant-meta-init-not-followed"
    breaks = "materializing a meta-device model (to_empty)"
    expect = Expect("reset_parameters", "thread", ("meta_init/reset_parameters",))
    patches = (Patch.instead("fsdp_impl.flat_param:FlatParamHandle.follow_moved_params", lambda self: None),)


class AssignedParamsNotAdopted(_Mutant):
    """After ``load_state_dict(..., assign=True)`` the unit keeps its old sharded parameters and shard: the loaded
    parameter objects are dropped at the next forward, and so is every value they brought."""

    name = "mutant-assigned-params-not-adopted"
    breaks = "taking the parameters load_state_dict(assign=True) puts in place as the sharded ones"
    expect = Expect("load_state_dict_assign", "thread", ("meta_init/load_state_dict_assign",))
    patches = (Patch.instead("fsdp_impl.composable:_adopt_registered", lambda handle: False),)


def _replicated(as_dtensor: Fn) -> Fn:
    def as_replicated_dtensor(self: Any, index: int, piece: Any, sharding: Any) -> Any:
        from torch.distributed.tensor import Replicate

        placements = tuple(Replicate() for _ in sharding.placements)
        return as_dtensor(self, index, piece, type(sharding)(sharding.mesh, placements))

    return as_replicated_dtensor


class ShardsClaimReplicated(_Mutant):
    """Each ``fully_shard``-ed parameter's DTensor claims to be replicated while it holds one rank's
    piece: a checkpoint records every piece as the whole parameter, a gradient norm covers one rank's."""

    name = "mutant-shards-claim-replicated"
    breaks = "the placements a sharded parameter reports (what DCP saves and reshards by)"
    expect = Expect(
        "(reshard and (4to2 or 2to4)) or clip_grad_norm", "thread", ("dcp/reshard", "grad_clip/clip_grad_norm"),
    )
    patches = (Patch("fsdp_impl.layout:ShardLayout.as_dtensor", _replicated),)


class MisuseUnchecked(_Mutant):
    """``fully_shard`` skips its argument checks: a module sharded twice, or a container without a
    forward, is accepted without a word."""

    name = "mutant-shard-args-unchecked"
    breaks = "refusing fully_shard misuse (a container without forward, a second application)"
    expect = Expect("fully_shard_api and container", "thread", ("fully_shard_api/misuse[kind=container]",))
    patches = (Patch.instead("fsdp_impl.composable:_check_module", lambda module: None),)


def _kept_in_param_dtype(config: Fn) -> Fn:
    def unit_config(*args: Any) -> Any:
        # Gradients kept with sync off add up in param_dtype (FSDP1's no_sync), not in reduce_dtype.
        return replace(config(*args), unsynced_in_reduce_dtype=False)

    return unit_config


class GradSyncKeepsGradInParamDtype(_Mutant):
    """With gradient sync off, the gradient a ``fully_shard``-ed module keeps adds up in ``param_dtype`` rather
    than in ``reduce_dtype``, which FSDP2's ``MixedPrecisionPolicy`` documents."""

    name = "mutant-grad-sync-keeps-grad-in-param-dtype"
    breaks = "accumulating gradients kept with gradient sync off in reduce_dtype"
    expect = Expect("unsynced_sums", "thread", ("mixed_precision/unsynced_sums[api=fully_shard]",))
    patches = (Patch("fsdp_impl.composable:_config", _kept_in_param_dtype),)


class ReduceScatterDivideFactorIgnored(_Mutant):
    """``set_reduce_scatter_divide_factor`` changes nothing: the module's gradients are still the mean over ranks."""

    name = "mutant-reduce-scatter-divide-factor-ignored"
    breaks = "the deprecated alias of set_gradient_divide_factor"
    expect = Expect("reduce_scatter_divide_factor", "thread", ("fully_shard_api/reduce_scatter_divide_factor",))
    patches = (Patch.instead("fsdp_impl.fsdp_module:FSDPModule.set_reduce_scatter_divide_factor",
                             lambda self, factor: None),)


def _partial_dropped(start: Fn) -> Fn:
    def start_all_reduce(unit: Any, grad: Any) -> Any:
        unit.partial_reduce = None  # what a backward without all-reduce kept is lost
        return start(unit, grad)

    return start_all_reduce


class PartialReductionDropped(_Mutant):
    """A backward without all-reduce keeps its reduce-scattered sum, but the synchronizing backward drops it."""

    name = "mutant-partial-reduction-dropped"
    breaks = "adding the sums kept by set_requires_all_reduce(False) into the next all-reduce"
    expect = Expect("requires_all_reduce", "thread", ("fully_shard_api/requires_all_reduce",))
    patches = (Patch("fsdp_impl.reduction:start_all_reduce", _partial_dropped),)


class AllReduceHookIgnored(_Mutant):
    """``set_all_reduce_hook`` registers nothing: the hook never runs."""

    name = "mutant-all-reduce-hook-ignored"
    breaks = "running the all-reduce hook on the reduced gradient"
    expect = Expect("all_reduce_hook", "thread", ("fully_shard_api/all_reduce_hook",))
    patches = (Patch.instead("fsdp_impl.fsdp_module:FSDPModule.set_all_reduce_hook",
                             lambda self, hook, *, stream=None: None),)


class ResetIterStateKeepsReductions(_Mutant):
    """``reset_iter_state`` keeps the failed backward's reductions in flight: the next backward adds them."""

    name = "mutant-reset-iter-state-keeps-reductions"
    breaks = "discarding the failed iteration's reductions in reset_iter_state"
    expect = Expect("reset_iter_state and backward", "thread", ("fully_shard_api/reset_iter_state[when=backward]",))
    patches = (Patch.instead("fsdp_impl.reduction:discard_reductions", lambda state: None),)
