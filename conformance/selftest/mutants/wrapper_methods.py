"""Mutants of FSDP1's methods on a wrapped model and of its wrapper-only arguments (``clip_grad_norm_``,
``apply``, ``summon_full_params(recurse=False)``, ``check_is_root``, ``fsdp_modules``, ``named_buffers``,
``register_comm_hook``, ``ignored_states``, ``MixedPrecision.cast_forward_inputs``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from conformance.selftest.declare import Expect, Patch, _Mutant
from fsdp_impl.precision import cast_floating

__all__ = ["ApplyKeepsNothing", "ClipNormInFloat32", "ClipNormOfLocalShards", "ClipScalesNothing", "CommHookIgnored",
           "EveryUnitIsRoot", "FsdpModulesLeaveOutTheModule", "IgnoredStatesDropped", "NamedBuffersKeepPrefixes",
           "SummonOwnUnitSkipped", "UnitInputsAlwaysCast", "UnitInputsNotCast"]

Fn = Callable[..., Any]


def _shards_counted_whole(grads: Fn) -> Fn:
    def counted_whole(root: Any, state: Any) -> tuple[list[Any], list[Any]]:
        sharded, whole = grads(root, state)
        return [], sharded + whole

    return counted_whole


class ClipNormOfLocalShards(_Mutant):
    """``clip_grad_norm_`` takes the norm of this rank's pieces of sharded gradients alone, over no rank (the
    infinity norm is not broken: the maximum over ranks of each rank's maximum is the maximum)."""

    name = "mutant-clip-norm-of-local-shards"
    breaks = "summing the sharded gradients' norms over the ranks"
    expect = Expect("grad_clip and wrapper_clip_grad_norm", "thread",
                    ("grad_clip/wrapper_clip_grad_norm[strategy=FULL_SHARD,norm_type=2]",
                     "grad_clip/wrapper_clip_grad_norm[strategy=FULL_SHARD,norm_type=1]"))
    patches = (Patch("fsdp_impl.unit_methods:_grads", _shards_counted_whole),)


def _in_float32(local_norm: Fn) -> Fn:
    def float32_norm(grads: list[Any], norm_type: float, dtype: Any, device: Any) -> Any:
        return local_norm(grads, norm_type, torch.float32, device)

    return float32_norm


class ClipNormInFloat32(_Mutant):
    """``clip_grad_norm_`` takes every norm in float32 whatever the gradients' dtype (narrowing a float64
    gradient, which torch's ``vector_norm`` refuses)."""

    name = "mutant-clip-norm-in-float32"
    breaks = "taking a float64 model's norm in float64"
    expect = Expect("wrapper_clip_grad_norm_float64 or repro_clip_grad_norm_float64", "thread",
                    ("grad_clip/wrapper_clip_grad_norm_float64", "fuzz/repro_clip_grad_norm_float64"))
    patches = (Patch("fsdp_impl.unit_methods:_local_norm", _in_float32),)


def _unclipped(clip: Fn) -> Fn:
    def norm_only(module: Any, max_norm: float, norm_type: float) -> Any:
        return clip(module, float("inf"), norm_type)

    return norm_only


class ClipScalesNothing(_Mutant):
    """``clip_grad_norm_`` returns the total norm but leaves the gradients as they were."""

    name = "mutant-clip-scales-nothing"
    breaks = "scaling the gradients to max_norm"
    expect = Expect("grad_clip and wrapper_clip_grad_norm", "process", ("grad_clip/wrapper_clip_grad_norm",))
    patches = (Patch("fsdp_impl.unit_methods:clip_grad_norm_", _unclipped),)


def _without_writeback(summon: Fn) -> Fn:
    def summon_discarding(module: Any, writeback: bool = True, with_grads: bool = False, **options: Any) -> Any:
        return summon(module, writeback=False, with_grads=with_grads, **options)

    return summon_discarding


def _own_unit_skipped(summon: Fn) -> Fn:
    def summon_recursing_only(module: Any, writeback: bool = True, with_grads: bool = False, *,
                              recurse: bool = True, **options: Any) -> Any:
        return summon(module, writeback, with_grads, recurse=recurse, **options) if recurse else nullcontext()

    return summon_recursing_only


class ApplyKeepsNothing(_Mutant):
    """``apply(fn)`` runs ``fn`` on the full parameters but writes nothing back into the shards (nor does any
    other ``summon_full_params``)."""

    name = "mutant-apply-keeps-nothing"
    breaks = "writing what apply's fn changed back into the shards"
    expect = Expect("wrapper_methods and apply", "thread", ("wrapper_methods/apply",))
    patches = (Patch("fsdp_impl.summon:summon_full_params", _without_writeback),)


class SummonOwnUnitSkipped(_Mutant):
    """``summon_full_params(module, recurse=False)`` summons nothing, as if ``module`` were no unit."""

    name = "mutant-summon-own-unit-skipped"
    breaks = "summoning a unit's own parameters without recursing"
    expect = Expect("stateful_ws2", "process", ("fuzz/stateful_ws2",))
    patches = (Patch("fsdp_impl.summon:summon_full_params", _own_unit_skipped),)


class EveryUnitIsRoot(_Mutant):
    """``check_is_root`` answers True for every unit."""

    name = "mutant-every-unit-is-root"
    breaks = "telling nested units from the root"
    expect = Expect("wrapper_methods and check_is_root", "process", ("wrapper_methods/check_is_root",))
    patches = (Patch.instead("fsdp_impl.unit_methods:check_is_root", lambda module: True),)


def _without_itself(units: Fn) -> Fn:
    def others(module: Any, root_only: bool) -> list[Any]:
        return [unit for unit in units(module, root_only) if unit is not module]

    return others


class FsdpModulesLeaveOutTheModule(_Mutant):
    """``fsdp_modules(module)`` leaves out ``module`` itself, a unit."""

    name = "mutant-fsdp-modules-leave-out-the-module"
    breaks = "including the module given, when it is a unit"
    expect = Expect("wrapper_methods and fsdp_modules", "thread", ("wrapper_methods/fsdp_modules",))
    patches = (Patch("fsdp_impl.unit_methods:fsdp_modules", _without_itself),)


class NamedBuffersKeepPrefixes(_Mutant):
    """The wrapper's ``named_buffers`` keeps its wrapper prefixes inside ``summon_full_params``."""

    name = "mutant-named-buffers-keep-prefixes"
    breaks = "removing the wrapper prefixes from buffer names inside summon_full_params"
    expect = Expect("wrapper_methods and named_buffers", "process", ("wrapper_methods/named_buffers",))
    patches = (Patch.instead("fsdp_impl.fully_sharded_data_parallel:FullyShardedDataParallel.named_buffers",
                             nn.Module.named_buffers),)


class CommHookIgnored(_Mutant):
    """``register_comm_hook`` accepts the hook and registers nothing: the wrapper reduces as without one."""

    name = "mutant-comm-hook-ignored"
    breaks = "reducing gradients through the registered communication hook"
    expect = Expect("wrapper_methods and comm_hook", "thread", ("wrapper_methods/comm_hook",))
    patches = (Patch.instead("fsdp_impl.unit_methods:register_comm_hook", lambda module, state, hook: None),)


class IgnoredStatesDropped(_Mutant):
    """The wrapper is built without the ``ignored_states`` given: those parameters are sharded and reduced."""

    name = "mutant-ignored-states-dropped"
    breaks = "leaving ignored_states unsharded and unreduced"
    expect = Expect("param_kinds and ignored_states", "thread", ("param_kinds/ignored_states",))
    spec_overrides = {"ignored_states": ()}


def _root_only(cast_inputs: Fn) -> Fn:
    def cast_at_root(unit: Any, inputs: Any) -> Any:
        return cast_inputs(unit, inputs) if unit.is_root else inputs

    return cast_at_root


class UnitInputsNotCast(_Mutant):
    """Only the root casts its forward inputs, whatever ``MixedPrecision.cast_forward_inputs`` says."""

    name = "mutant-unit-inputs-not-cast"
    breaks = "casting a nested unit's inputs with cast_forward_inputs"
    expect = Expect("mixed_precision and cast_unit_forward_inputs", "process",
                    ("mixed_precision/cast_unit_forward_inputs[cast=True]",))
    patches = (Patch("fsdp_impl.precision:cast_inputs", _root_only),)


def _every_unit(cast_inputs: Fn) -> Fn:
    def cast_everywhere(unit: Any, inputs: Any) -> Any:
        policy = unit.config.low_precision(unit.training)
        return inputs if policy is None else cast_floating(inputs, policy.param_dtype)

    return cast_everywhere


class UnitInputsAlwaysCast(_Mutant):
    """Every unit casts its forward inputs under mixed precision, without ``MixedPrecision.cast_forward_inputs``."""

    name = "mutant-unit-inputs-always-cast"
    breaks = "leaving a nested unit's inputs alone without cast_forward_inputs"
    expect = Expect("mixed_precision and cast_unit_forward_inputs", "process",
                    ("mixed_precision/cast_unit_forward_inputs[cast=False]",))
    patches = (Patch("fsdp_impl.precision:cast_inputs", _every_unit),)
