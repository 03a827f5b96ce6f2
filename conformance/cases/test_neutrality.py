"""neutrality: a performance knob changes no value a user can read.

[Note: performance knobs]
Some options promise speed or memory and nothing else: prefetching, rate
limits, which process group or buffers carry a collective. Their effect on time
is not observable on a CPU (the timing cases measure prefetch where it can be
seen), but their *neutrality* is, on any machine: a model wrapped with the knob
on must train exactly like the same model wrapped with it off. A row wraps two
identically seeded models, one with the knob on, feeds both the same batches
and compares, step by step, the losses, the full gradients (where the adapter
exposes them), the full parameters after each optimizer step, and the full
state dict at the end. The comparison uses torch's float32 tolerances rather
than equality: a knob may legitimately reorder a reduction (a sum divided
afterwards instead of pre-scaled), which changes rounding, not values.

Knobs that :class:`~conformance.contract.adapter.WrapSpec` carries are turned on
through it (any implementation accepts ``forward_prefetch`` and
``limit_all_gathers`` as hints; backward prefetch other than the default needs
``BACKWARD_PREFETCH``). The others belong to one implementation: the adapter
lists them (``performance_knobs``) and turns one on after the wrap
(``set_performance_knob``; :mod:`conformance.contract.optional`); a row whose
knob the adapter does not list is ``n/a``.

A few knobs are construction options (FSDP2's ``CPUOffloadPolicy.pin_memory``):
the adapter lists them (``wrap_knobs``) and gives the specs the two models are
wrapped with (``knob_specs``), alike but for the knob.

A knob that no value can show is still checked for doing what it says where
the collectives it issues can show it (:data:`EFFECTS`), so that an ignored
knob cannot pass as a neutral one: with ``separate_reduce_scatter_group`` on
(the root's ``set_separate_reduce_scatter_group(True)``, recursive by
default), every reduce-scatter of each step runs on a process group that
carries none of the model's all-gathers, as its docstring promises ("gives
reduce-scatter its own process group").

Cases:

- ``knob``: one row per knob of :data:`KNOBS`; three Linear units of uneven
  size (11 x 11 on two ranks), three SGD steps. Process ranks only: the knobs
  act on real process groups (one asks the group's backend for an allocator,
  which torch's threaded test group does not have), and whether a knob changes
  values does not depend on how ranks are hosted. The knobs of
  :data:`GPU_KNOBS` only act on a GPU, so their rows are GPU rows (skipped on a
  CPU-only machine, never passed there): pinned host memory needs an
  accelerator (without one the offloaded model could only be compared with
  itself), and ``set_symm_mem_for_comm`` allocates NCCL symmetric memory, one
  GPU per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import ANY_GPU, TWO_OR_MORE, GpuNeed, case, distinct_gpus, not_applicable
from conformance.fuzz.gathers import GATHERS, REDUCTIONS
from fixtures.models import ThreeLinear
from fixtures.parity import assert_close_named, assert_close_seq
from fixtures.seeding import generator
from harness.collectives.recorder import Trace

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["GPU_KNOBS", "KNOBS", "SPEC_KNOBS"]

#: Knobs a :class:`WrapSpec` carries: the knob's name -> the spec's fields with it on.
SPEC_KNOBS: dict[str, dict[str, Any]] = {
    "forward_prefetch": {"forward_prefetch": True},
    "backward_post": {"backward_prefetch": "BACKWARD_POST"},
    "no_backward_prefetch": {"backward_prefetch": None},
    "unlimited_all_gathers": {"limit_all_gathers": False},
}
#: Every knob a row exists for: :data:`SPEC_KNOBS`, then those an adapter turns on itself
#: (``set_performance_knob``). torch's FSDP2 offers the latter through ``FSDPModule`` and
#: ``torch.distributed.fsdp.share_comm_ctx``.
KNOBS = (*SPEC_KNOBS, "share_comm_ctx", "separate_reduce_scatter_group", "reduce_scatter_input_buffers",
         "allocate_from_process_group", "force_sum_reduction", "offload_pin_memory", "symm_mem_for_comm")
#: Knobs that act only on a GPU -> the GPUs their row needs.
GPU_KNOBS: dict[str, GpuNeed] = {"offload_pin_memory": ANY_GPU, "symm_mem_for_comm": distinct_gpus(2)}
STEPS = 3
DIM = 11
UNITS = AutoWrap((nn.Linear,))


def _reduce_scatters_on_their_own_group(calls: Trace) -> str | None:
    """Why the step's reduce-scatters do not all run on groups that carry none of its all-gathers (``None``:
    they do)."""
    gathers = calls.require(GATHERS, "the step's all-gathers")
    scatters = calls.require(REDUCTIONS, "the step's reduce-scatters")
    gathering = {call.group_name for call in gathers}
    shared = [call for call in scatters if call.group_name in gathering or not call.group_name]
    if not shared:
        return None
    return (f"{len(shared)} of {len(scatters)} reduce-scatters ran on the all-gathers' group "
            f"({sorted(gathering)}), not on one of their own")


#: Knobs whose effect the step's collectives show -> why they do not show it (``None``: they do).
EFFECTS: dict[str, Callable[[Trace], str | None]] = {
    "separate_reduce_scatter_group": _reduce_scatters_on_their_own_group,
}


def _requires(params: Mapping[str, Any]) -> list[Capability]:
    offloaded = {"cpu_offload": True} if params["knob"] == "offload_pin_memory" else {}
    return WrapSpec(**SPEC_KNOBS.get(params["knob"], offloaded)).required()


def _gpus(params: Mapping[str, Any]) -> GpuNeed | None:
    return GPU_KNOBS.get(params["knob"])


def _pair(ctx: RankContext, impl: FSDPAdapter, base: WrapSpec, knob: str) -> tuple[nn.Module, nn.Module]:
    """The model wrapped with ``knob`` off, and with it on."""
    if knob in SPEC_KNOBS:
        return _wrap(ctx, impl, base), _wrap(ctx, impl, replace(base, **SPEC_KNOBS[knob]))
    if knob in optional.wrap_knobs(impl):
        spec_off, spec_on = optional.knob_specs(impl, base, knob)
        return _wrap(ctx, impl, spec_off), _wrap(ctx, impl, spec_on)
    offered = optional.performance_knobs(impl) | optional.wrap_knobs(impl)
    if knob not in offered:
        not_applicable(f"{impl.name} offers no performance knob {knob!r} (it offers {sorted(offered) or 'none'})")
    off, on = _wrap(ctx, impl, base), _wrap(ctx, impl, base)
    optional.set_performance_knob(impl, on, knob)
    return off, on


def _wrap(ctx: RankContext, impl: FSDPAdapter, spec: WrapSpec) -> nn.Module:
    return impl.wrap(ThreeLinear(seed=3, dim=DIM).to(ctx.device), spec)


def _train(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """One forward and backward of ``model`` on ``batch``; the loss."""
    loss = model(batch).square().mean()
    loss.backward()
    return loss.detach()


def _state(impl: FSDPAdapter, model: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in impl.full_state_dict(model).items() if isinstance(value, torch.Tensor)}


@case("neutrality/knob", clause="C22", world_size=TWO_OR_MORE, modes=("process",), requires=_requires,
      uses=[Capability.FULL_STATE_DICT], gpus=_gpus)
@pytest.mark.parametrize("knob", KNOBS)
def test_knob(ctx: RankContext, impl: FSDPAdapter, knob: str) -> None:
    """With the knob on, three SGD steps give the losses, full gradients, parameters and full state dict of
    the same model wrapped with it off (float32 tolerances; [Note: performance knobs])."""
    off, on = _pair(ctx, impl, WrapSpec(auto_wrap=UNITS, use_orig_params=True), knob)
    optims = [optional.optimizer(impl, model, torch.optim.SGD, lr=0.1) for model in (off, on)]
    gen = generator(11)
    for step in range(STEPS):
        batch = torch.randn((4, DIM), generator=gen).to(ctx.device)
        losses = []
        for model in (off, on):
            if model is on and knob in EFFECTS:  # the knob's model, where its collectives can show it
                with ctx.record_collectives() as calls:
                    losses.append(_train(model, batch))
                effect = EFFECTS[knob](calls)
                assert effect is None, f"rank {ctx.rank}, {knob} on, step {step}: the knob had no effect: {effect}"
            else:
                losses.append(_train(model, batch))
        what = f"rank {ctx.rank}, {knob} on against off, step {step}"
        assert_close_seq(losses[1:], losses[:1], what=f"{what}: loss")
        grads = [optional.full_grads(impl, model) for model in (off, on)]
        if grads[0] is not None and grads[1] is not None:
            assert_close_named(grads[1], grads[0], what=f"{what}: full gradients")
        for model, optim in zip((off, on), optims, strict=True):
            optional.step(impl, model, optim)
            optim.zero_grad(set_to_none=True)
        assert_close_named(impl.full_params(on), impl.full_params(off), what=f"{what}: parameters after the step")
    if Capability.FULL_STATE_DICT in optional.capabilities_of(impl):
        assert_close_named(_state(impl, on), _state(impl, off), what=f"rank {ctx.rank}, {knob}: full state dict")
