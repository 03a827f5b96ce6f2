"""Mutants for ``fully_shard_options``: the reference's ``FSDPModule`` methods and ``fully_shard`` options of
that area, each broken alone; for what only torch's ``fully_shard`` has, torch-fsdp2 with it accepted and dropped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch.nn as nn

from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.selftest.declare import Expect, Patch, _Mutant

__all__ = ["NotLastBackwardDropsReductions", "UnshardInBackwardIgnored", "ForwardMethodNotRegistered",
           "OutputDtypeIgnored", "ShardPlacementFnDropped",
           "CustomCommsDropped", "UnusedParamsNotReduced", "SeparateReduceScatterGroupIgnored", "ModuleGroupSplit"]

Fn = Callable[..., Any]


def _drops_pending(final_callback: Fn) -> Fn:
    def end_of_backward(state: Any) -> None:
        if not all(unit.controls.is_last_backward for unit in state.units if unit.is_root):
            state.reductions.clear()  # the reductions left in flight are forgotten, not finished later
        final_callback(state)

    return end_of_backward


class NotLastBackwardDropsReductions(_Mutant):
    """A backward marked as not the last forgets the reductions it left in flight (the last units' gradients
    of that micro-batch never reach ``.grad``)."""

    name = "mutant-not-last-backward-drops-reductions"
    breaks = "finishing a non-last backward's reductions in a later backward"
    expect = Expect("is_last_backward", "thread", ("fully_shard_options/is_last_backward",))
    patches = (Patch("fsdp_impl.unit:_final_callback", _drops_pending),)


class UnshardInBackwardIgnored(_Mutant):
    """``set_unshard_in_backward(False)`` changes nothing: backward all-gathers the embedding as any unit."""

    name = "mutant-unshard-in-backward-ignored"
    breaks = "skipping the all-gather in backward of a module whose backward reads no parameter"
    expect = Expect("unshard_in_backward", "thread", ("fully_shard_options/unshard_in_backward",))
    patches = (Patch.instead("fsdp_impl.fsdp_module:FSDPModule.set_unshard_in_backward", lambda self, on: None),)


class ForwardMethodNotRegistered(_Mutant):
    """``register_fsdp_forward_method`` registers nothing: the method computes on the sharded parameters."""

    name = "mutant-forward-method-not-registered"
    breaks = "gathering the parameters for a method registered as a forward method"
    expect = Expect("forward_method", "thread", ("fully_shard_options/forward_method",))
    patches = (Patch.instead("fsdp_impl:register_fsdp_forward_method", lambda module, method_name: None),)


def _no_output_cast(config: Fn) -> Fn:
    def unit_config(*args: Any) -> Any:
        return replace(config(*args), output_dtype=None)

    return unit_config


class OutputDtypeIgnored(_Mutant):
    """``MixedPrecisionPolicy.output_dtype`` is dropped: outputs stay in the dtype the module computed in."""

    name = "mutant-output-dtype-ignored"
    breaks = "casting a fully_shard-ed module's floating outputs to output_dtype"
    expect = Expect("output_dtype", "thread", ("fully_shard_options/output_dtype",))
    patches = (Patch("fsdp_impl.composable:_config", _no_output_cast),)


class ShardPlacementFnDropped(TorchFSDP2Adapter):
    """torch-fsdp2 whose ``fully_shard`` drops ``shard_placement_fn``: every parameter is sharded on dim 0."""

    name = "mutant-fsdp2-shard-placement-fn-dropped"
    breaks = "sharding parameters on the dims shard_placement_fn gives"
    # Only torch-fsdp2 takes a shard_placement_fn, so this mutant derives from its adapter.
    expect: ClassVar[Expect] = Expect("shard_placement_fn", "thread", ("fully_shard_options/shard_placement_fn",))

    def fully_shard(self, module: nn.Module | Sequence[nn.Module], *, shard_placement_fn: Any = None,
                    **kwargs: Any) -> nn.Module:
        return super().fully_shard(module, **kwargs)


class CustomCommsDropped(TorchFSDP2Adapter):
    """torch-fsdp2 whose ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` are accepted and dropped: the
    module's collectives stay torch's default ones."""

    name = "mutant-fsdp2-custom-comms-dropped"
    breaks = "issuing a module's collectives through the custom all-gather and reduce-scatter"
    # Only torch-fsdp2 takes custom collectives, so this mutant derives from its adapter.
    expect: ClassVar[Expect] = Expect("custom_comms", "thread", ("fully_shard_options/custom_comms",))

    def set_custom_comms(self, module: nn.Module, *, all_gather: Any, reduce_scatter: Any) -> None:
        return None


class UnusedParamsNotReduced(TorchFSDP2Adapter):
    """torch-fsdp2 whose ``set_reduce_scatter_unused_params`` is accepted and dropped: a rank whose backward gave a
    parameter no gradient leaves it out of its reduce-scatter, which no longer matches the other ranks'."""

    name = "mutant-fsdp2-unused-params-not-reduced"
    breaks = "reducing, as zeros, the parameters a rank's backward gave no gradient"
    expect: ClassVar[Expect] = Expect("reduce_scatter_unused_params", "thread",
                                      ("fully_shard_options/reduce_scatter_unused_params",))

    def set_reduce_scatter_unused_params(self, module: nn.Module, on: bool) -> None:
        return None


class SeparateReduceScatterGroupIgnored(TorchFSDP2Adapter):
    """torch-fsdp2 whose ``separate_reduce_scatter_group`` knob is accepted and dropped: every reduce-scatter stays on
    the all-gathers' group, which changes no value, so only the knob's effect check can tell."""

    name = "mutant-fsdp2-separate-reduce-scatter-group-ignored"
    breaks = "running the reduce-scatters on a process group of their own"
    expect: ClassVar[Expect] = Expect("neutrality", "process",
                                      ("neutrality/knob[knob=separate_reduce_scatter_group]",))

    def set_performance_knob(self, model: nn.Module, knob: str) -> None:
        if knob != "separate_reduce_scatter_group":
            super().set_performance_knob(model, knob)


class ModuleGroupSplit(TorchFSDP2Adapter):
    """torch-fsdp2 whose ``fully_shard`` of a list shards each module on its own: the values are the same, but
    the group's parameters travel in one collective per module instead of one for the group."""

    name = "mutant-fsdp2-module-group-split"
    breaks = "all-gathering a group of modules sharded by one fully_shard call in one collective"
    # Only torch-fsdp2 shards a list of modules as one group, so this mutant derives from its adapter.
    expect: ClassVar[Expect] = Expect("module_group", "thread", ("fully_shard_options/module_group",))

    def fully_shard(self, module: Any, **kwargs: Any) -> Any:
        if isinstance(module, nn.Module):
            return super().fully_shard(module, **kwargs)
        return [super(ModuleGroupSplit, self).fully_shard(each, **kwargs) for each in module]
