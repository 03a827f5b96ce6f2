"""Mutants of state between iterations: optimizer state, loads mid-iteration, gradients across a
forward without gradients, saves between forward and backward, buffers saved in their compute dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch

from conformance.selftest.declare import Expect, Patch, _Mutant, drop_grads

__all__ = ["OptimStateNotLoaded", "LoadRefusedAfterForward", "NoGradForwardDropsGrads", "OptimLoadNeedsState",
           "OptimSaveStepsEmptyState",
           "SummonKeepsFullPrecision", "BuffersSavedInBufferDtype", "ShardedSaveDropsAttributes",
           "ShardedParamsClaimReplicated", "ShardedParamsAllTrainable"]

Fn = Callable[..., Any]


def _without_state(to_load: Fn) -> Fn:
    def to_load_dropping_state(model: Any, optim: Any, osd: Any) -> Any:
        return {**to_load(model, optim, osd), "state": {}}

    return to_load_dropping_state


class OptimStateNotLoaded(_Mutant):
    """Loads an optimizer state dict's hyperparameters but drops its per-parameter state."""

    name = "mutant-optim-state-not-loaded"
    breaks = "loading optimizer state (e.g. Adam's moments)"
    #: (The stateful fuzzer's rows reach it at seed 0 with the main job's budget no longer: the programs drawn moved
    #: when ClipGradNorm and ScaleParams joined the operations.)
    expect = Expect(
        "roundtrip or cross_impl", "thread", ("state_dict/roundtrip", "state_dict/cross_impl[dst=reference]"),
    )
    patches = (Patch("fsdp_impl.state_dict:optim_state_dict_to_load", _without_state),)


def _refusing_unsharded(check_idle: Fn) -> Fn:
    def check_idle_and_resharded(units: Any) -> None:
        check_idle(units)
        held = [u.fqn_prefix or "<root>" for u in units if u.handle.state.name != "SHARDED"]
        if held:
            raise RuntimeError(f"state dicts need resharded units; {held} still hold unsharded parameters")

    return check_idle_and_resharded


class LoadRefusedAfterForward(_Mutant):
    """Refuses state-dict loads while a unit still holds parameters from a forward."""

    name = "mutant-load-refused-after-forward"
    breaks = "loading a state dict after a forward (e.g. rolling back an abandoned iteration)"
    expect = Expect(
        "load_in_loop and after_forward", "thread", ("state_dict/load_in_loop[point=after_forward]",),
    )
    patches = (Patch("fsdp_impl.summon:check_idle", _refusing_unsharded),)


def _dropping_grads_without_grad(pre_forward: Fn) -> Fn:
    def pre_forward_dropping_grads(unit: Any, state: Any, recompute: bool) -> None:
        if not torch.is_grad_enabled() and unit.handle is not None:
            drop_grads(unit.handle)  # as if the forward started a new iteration
        pre_forward(unit, state, recompute)

    return pre_forward_dropping_grads


class NoGradForwardDropsGrads(_Mutant):
    """A forward under ``torch.no_grad()`` forgets the gradients the last backward left for the
    optimizer (an evaluation forward between backward and step loses the step)."""

    name = "mutant-no-grad-forward-drops-grads"
    breaks = "keeping gradients across a forward without gradients"
    #: Its reproducers, and the stateful fuzzer at world size 1 with the main job's budget (seed 0): a
    #: backward, then a forward without gradients, then a check that reads the gradients or a step before
    #: zero_grad (world size 1 since ClipGradNorm and ScaleParams joined the operations, 2 before).
    expect = Expect("repro_no_grad_forward_before_step or repro_no_grad_forward_unsharded_params or stateful_ws1",
                    "thread", ("fuzz/repro_no_grad_forward_before_step", "fuzz/repro_no_grad_forward_unsharded_params",
                               "fuzz/stateful_ws1"))
    patches = (Patch("fsdp_impl.unit:_pre_forward", _dropping_grads_without_grad),)


def _needing_state(to_load: Fn) -> Fn:
    def to_load_needing_state(model: Any, optim: Any, osd: Any) -> Any:
        if not osd.get("state"):
            raise AssertionError("optimizer state dict has no per-parameter state to load")
        return to_load(model, optim, osd)

    return to_load_needing_state


def _stepping_empty_state(save: Fn) -> Fn:
    def save_stepping_empty_state(model: Any, optim: torch.optim.Optimizer) -> Any:
        if not optim.state:  # fills the state with a step on zero gradients (it counts for Adam)
            for group in optim.param_groups:
                for param in group["params"]:
                    if param.requires_grad and param.grad is None:
                        param.grad = torch.zeros_like(param)
            optim.step()
            optim.zero_grad(set_to_none=True)
        return save(model, optim)

    return save_stepping_empty_state


class OptimSaveStepsEmptyState(_Mutant):
    """An optimizer state dict taken before the first step runs a step on zero gradients first, so
    Adam's first real step is its second (torch-fsdp2's, see fuzz/repro_optim_state_dict_before_first_step_adam)."""

    name = "mutant-optim-save-steps-empty-state"
    breaks = "leaving the optimizer as it was when saving its state before the first step"
    expect = Expect("repro_optim_state_dict_before_first_step_adam", "thread",
                    ("fuzz/repro_optim_state_dict_before_first_step_adam",))
    patches = (Patch("fsdp_impl.state_dict:optim_state_dict", _stepping_empty_state),)


class OptimLoadNeedsState(_Mutant):
    """Refuses to load an optimizer state dict that holds no per-parameter state, as one saved before
    the first step does (torch-fsdp2's full load, see fuzz/repro_full_optim_load_before_first_step)."""

    name = "mutant-optim-load-needs-state"
    breaks = "loading an optimizer state dict saved before the first step"
    expect = Expect("repro_full_optim_load_before_first_step", "thread",
                    ("fuzz/repro_full_optim_load_before_first_step",))
    patches = (Patch("fsdp_impl.state_dict:optim_state_dict_to_load", _needing_state),)


def _staying_in_full_precision(summon: Fn) -> Fn:
    @contextlib.contextmanager
    def summon_staying_in_full_precision(module: Any, *args: Any, **kwargs: Any) -> Generator[None, None, None]:
        from fsdp_impl.unit_state import unit_states

        with summon(module, *args, **kwargs):
            yield
        for unit in unit_states(module):  # the next all-gather (backward's too) is in full precision
            if unit.handle is not None:
                unit.handle.set_full_precision(True)

    return summon_staying_in_full_precision


class SummonKeepsFullPrecision(_Mutant):
    """After ``summon_full_params`` (and so a full state dict) the units keep gathering in the parameters'
    dtype instead of the policy's ``param_dtype`` until the next forward: a backward after a save
    between forward and backward gathers into other storage than its forward computed on."""

    name = "mutant-summon-keeps-full-precision"
    breaks = "computing backward in the param dtype after a state dict between forward and backward"
    expect = Expect("repro_full_state_dict_mid_iteration_bf16", "thread",
                    ("fuzz/repro_full_state_dict_mid_iteration_bf16",))
    patches = (Patch("fsdp_impl.summon:summon_full_params", _staying_in_full_precision),)


class BuffersSavedInBufferDtype(_Mutant):
    """With a ``buffer_dtype``, state dicts after a forward hold the buffers in that dtype (bfloat16), as
    they compute, not in the dtype they were built in."""

    name = "mutant-buffers-saved-in-buffer-dtype"
    breaks = "saving buffers in the dtype they were built in"
    expect = Expect("repro_buffer_dtype_checkpointed_state_dict or buffer_dtype_state_dict", "thread",
                    ("fuzz/repro_buffer_dtype_checkpointed_state_dict", "mixed_precision/buffer_dtype_state_dict"))
    patches = (Patch.instead("fsdp_impl.state_dict:_buffer_dtypes", lambda _root: {}),)


def _dropping_attributes(unregister: Fn) -> Fn:
    def unregister_dropping_attributes(unit: Any) -> None:
        unregister(unit)
        if not unit.handle.use_orig_params:  # the modules keep no attribute for their parameters
            for slot in unit.handle.slots:
                for module, name in slot.registrations:
                    module.__dict__.pop(name, None)

    return unregister_dropping_attributes


class ShardedSaveDropsAttributes(_Mutant):
    """With flat parameters, a sharded state dict leaves the modules without their parameter attributes
    until the next forward: a checkpointed block recomputed in the backward that follows finds none."""

    name = "mutant-sharded-save-drops-attributes"
    breaks = "a backward after a sharded state dict taken between forward and backward"
    expect = Expect("repro_sharded_state_dict_before_recompute", "thread",
                    ("fuzz/repro_sharded_state_dict_before_recompute",))
    patches = (Patch("fsdp_impl.summon:unregister_orig", _dropping_attributes),)


def _claiming_replicate(as_dtensor: Fn) -> Fn:
    def as_replicated_dtensor(layout: Any, index: int, piece: Any, sharding: Any) -> Any:
        from torch.distributed.tensor import Replicate

        return as_dtensor(layout, index, piece, sharding._replace(placements=(Replicate(),) * len(sharding.placements)))

    return as_replicated_dtensor


class ShardedParamsClaimReplicated(_Mutant):
    """``fully_shard``'s DTensor parameters hold this rank's piece but say ``Replicate``: whatever reads the
    placements (``full_tensor()``, ``torch.distributed.checkpoint.state_dict``) takes a piece for the whole."""

    name = "mutant-sharded-params-claim-replicated"
    breaks = "the placements of fully_shard's DTensor parameters"
    expect = Expect("state_dict_options", "thread", (
        "state_dict_options/cpu_offload_full", "state_dict_options/broadcast_from_rank0",
        "state_dict_options/strict[strict=False]", "state_dict_options/submodules",
        "state_dict_options/flatten_optimizer_state_dict", "state_dict_options/dsd_fqn_modifiers"))
    patches = (Patch("fsdp_impl.layout:ShardLayout.as_dtensor", _claiming_replicate),)


def _all_trainable(install: Fn) -> Fn:
    def install_trainable(handle: Any) -> None:
        install(handle)
        for slot in handle.slots:
            slot.param.requires_grad_(True)

    return install_trainable


class ShardedParamsAllTrainable(_Mutant):
    """Sharding drops ``requires_grad=False``: a frozen parameter comes back trainable."""

    name = "mutant-sharded-params-all-trainable"
    breaks = "frozen parameters staying frozen under fully_shard"
    expect = Expect("ignore_frozen_params", "thread", ("state_dict_options/ignore_frozen_params",))
    patches = (Patch("fsdp_impl.flat_param:FlatParamHandle.install_sharded_params", _all_trainable),)
