"""fuzz: the parity fuzzer's rows, ``fuzz/parity_ws*``, and the stateful fuzzer's, ``fuzz/stateful_ws*``, one
per world size (see :mod:`conformance.fuzz`), with reproducers pasted below them and fixed programs.

A parity row draws ``--fuzz-examples`` (``FSDP_FUZZ_EXAMPLES``) examples (default: 12, 15 and 3 for world sizes
1, 2 and 4) from ``--fuzz-seed`` (``FSDP_FUZZ_SEED``, default 0), runs each on the implementation and on a local
baseline, and on a mismatch fails with the shrunk example as a ready-to-paste case. A fifth to a third of the
examples draw a mixed-precision policy (``conformance.fuzz.drawn_precision``, [Note: low-precision reductions in the
fuzzer]); without ``Capability.MIXED_PRECISION`` (or ``MP_BUFFER_DTYPE``) the policy (or its buffer dtype) is
dropped, the example runs in full precision, and the row's reason says so.

A stateful row draws ``--fuzz-stateful-examples`` (``FSDP_FUZZ_STATEFUL_EXAMPLES``) programs (default: 5, 5
and 2) from ``--fuzz-seed``: a configuration (strategy, ``use_orig_params``, mixed precision, CPU offload,
activation checkpointing, frozen and tied parameters; sharded by ``wrap``, or by ``fully_shard`` where declared)
and a random sequence of a user's operations, on a ``fully_shard``-ed model also its controls where declared
([Note: stateful programs] in :mod:`conformance.fuzz.ops`). Every operation runs on the implementation and on
a local shadow model, and the user-visible state must agree after each one ([Note: stateful invariant]); a
mismatch fails with the shrunk program as a ready-to-paste case. What the adapter cannot express is left out
and said in the row's reason: configuration features are dropped after drawing, and operations it lacks
(``no_sync``, state dicts a rank mode cannot take) are skipped on both sides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import TWO_OR_MORE, CaseSettings, Exact, case
from conformance.contract.results import CaseReport
from conformance.fuzz.driver import FuzzSettings, parity_row
from conformance.fuzz.example import FUZZ_STRATEGIES, ONE_RANK, ONE_RANK_BF16, Block, Example, ModelSpec, Policy
from conformance.fuzz.neighbours import NEIGHBOURS_USE
from conformance.fuzz.ops import (
    Backward,
    ClipGradNorm,
    Forward,
    FullyShardConfig,
    GradientDivideFactor,
    GradSync,
    Load,
    NoSync,
    Prefetch,
    Program,
    Reshard,
    ReshardAfterBackward,
    Save,
    SetReshardAfterForward,
    Step,
    Train,
    Unshard,
    WrapConfig,
)
from conformance.fuzz.parity_run import run_example
from conformance.fuzz.searching import budget, stateful_row
from conformance.fuzz.stateful import run_program

#: What the parity fuzzer draws only where the adapter declares it (drawn_precision.precision_features).
_DRAWN = (Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE)

if TYPE_CHECKING:
    from harness import RankContext

def _timeout_s(settings: CaseSettings) -> float:
    """Pool start and three world sizes' worth of examples, each well under a second; shrinking a
    failure runs a few hundred more."""
    return 120.0 + 3.0 * FuzzSettings.of(settings).budget(2)


@case("fuzz/parity_ws1", clause=("C1", "C2"), world_size=1, modes=("process",), timeout_s=_timeout_s, uses=_DRAWN,
      draws_strategies=FUZZ_STRATEGIES)
def test_parity_ws1(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """Random models, wrap plans and training loops on one rank give the local model's losses, grads and params;
    a mismatch fails with a shrunk reproducer."""
    return parity_row(ctx, impl, case_settings)


@case("fuzz/parity_ws2", clause=("C1", "C2"), world_size=2, modes=("process",), timeout_s=_timeout_s, uses=_DRAWN,
      draws_strategies=FUZZ_STRATEGIES)
def test_parity_ws2(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """As ``fuzz/parity_ws1`` on two ranks: losses, grads and params match the local model (uneven shards for
    odd widths)."""
    return parity_row(ctx, impl, case_settings)


@case("fuzz/parity_ws4", clause=("C1", "C2"), world_size=4, modes=("process",), timeout_s=_timeout_s, uses=_DRAWN,
      draws_strategies=FUZZ_STRATEGIES)
def test_parity_ws4(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """As ``fuzz/parity_ws1`` on four ranks: losses, grads and params match the local model (small units leave
    some ranks with empty shards)."""
    return parity_row(ctx, impl, case_settings)


# -- reproducers the fuzzer found ---------------------------------------------------------------

# Found by the parity fuzzer (seed 1) in torch-fsdp1: after backward the unused unit's parameters are
# missing from the module (docs/findings/fsdp1-no-shard-unused-unit-params.md).
@case("fuzz/repro_no_shard_unused_unit_params", clause=("C1", "C2"), world_size=ONE_RANK)
def test_repro_no_shard_unused_unit_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    """One rank, use_orig_params: a unit the forward never uses keeps its parameters registered on the
    module after backward, and losses, grads and params after each step match the local model."""
    run_example(ctx, impl, Example(world_size=1, model=ModelSpec(blocks=(Block(inner=("linear",)),), unused=True),
                                   wrap=("unused",), use_orig_params=True))


# Found by the parity fuzzer (seed 1, world size 4) in torch-fsdp1: a rank died (gloo: "Received data size
# doesn't match expected size") reading full gradients of a float64 unit whose last shard is padding only
# (docs/findings/fsdp1-summon-grads-float64-padding-shard.md). Written by hand from the finding: a crash
# cannot be shrunk. On thread ranks torch-fsdp1 hangs instead of dying; the timeout leaves room for a fresh
# pool of four ranks warming up on a loaded 2-core machine (about 30 s), not for the default 120 s.
@case("fuzz/repro_summon_grads_float64_padding_shard", clause=("C1", "C2"), world_size=4, timeout_s=90.0)
def test_repro_summon_grads_float64_padding_shard(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Four ranks, a float64 unit whose last rank's shard is padding only: reading its full gradients
    works on every rank (no rank dies or hangs), and losses, grads and params match the local model."""
    run_example(ctx, impl, Example(world_size=4, wrap=("blocks.0",), use_orig_params=True, dtype="float64"))


# Found by the parity fuzzer (seed 0, 60 examples) in torch-fsdp1: with a bfloat16 reduction, NO_SHARD (what
# FSDP1 runs at world size 1) adds a second backward's gradient to the first in bfloat16, where the sharded
# strategies add in float32 (docs/findings/fsdp1-no-shard-low-precision-accumulation.md).
@case("fuzz/repro_no_shard_low_precision_accumulation",
      clause=("C13", "C3"), world_size=ONE_RANK, requires=[Capability.MIXED_PRECISION])
def test_repro_no_shard_low_precision_accumulation(ctx: RankContext, impl: FSDPAdapter) -> None:
    """One rank, bfloat16 params and reduction, two backwards per step: outputs come out in bfloat16, and
    losses, grads (each backward's reduced gradient added to the float32 one, not summed in bfloat16) and
    params match the local mixed-precision baseline."""
    run_example(ctx, impl, Example(world_size=1, policy=Policy(), micro_batches=2))


# -- the stateful fuzzer ------------------------------------------------------------------------------------------


def _stateful_timeout_s(settings: CaseSettings) -> float:
    """Pool start and the budget's programs, each a second or two at world size 4 on two loaded cores;
    shrinking a failure runs a few hundred more."""
    return 120.0 + 5.0 * budget(settings, 4)


#: What the stateful fuzzer draws only where the adapter declares it (wrapping.features_of), and what its neighbours
#: wrap with.
_STATEFUL_DRAWN = (Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE, Capability.CPU_OFFLOAD,
                   Capability.HYBRID_VIA_PG_TUPLE, Capability.MP_CAST_FORWARD_INPUTS,
                   Capability.FULLY_SHARD, Capability.RESHARD_AFTER_FORWARD_INT, Capability.FULLY_SHARD_CONTROLS,
                   Capability.EXPLICIT_PREFETCH, Capability.IGNORED_MODULES, Capability.FULLY_SHARD_MIXED_PRECISION,
                   Capability.SET_RESHARD_AFTER_FORWARD, Capability.GRADIENT_DIVIDE_FACTOR, *NEIGHBOURS_USE)


@case("fuzz/stateful_ws1", world_size=1, timeout_s=_stateful_timeout_s, uses=_STATEFUL_DRAWN,
      clause=("C1", "C2", "C11"),
      draws_strategies=FUZZ_STRATEGIES)
def test_stateful_ws1(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """Random sequences of a user's operations on one rank keep the wrapped model equal to the shadow."""
    return stateful_row(ctx, impl, case_settings)


@case("fuzz/stateful_ws2", world_size=2, timeout_s=_stateful_timeout_s, uses=_STATEFUL_DRAWN,
      clause=("C1", "C2", "C11"),
      draws_strategies=FUZZ_STRATEGIES)
def test_stateful_ws2(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """... on two ranks (gradients averaged over them)."""
    return stateful_row(ctx, impl, case_settings)


@case("fuzz/stateful_ws4", world_size=4, timeout_s=_stateful_timeout_s, uses=_STATEFUL_DRAWN,
      clause=("C1", "C2", "C11"),
      draws_strategies=FUZZ_STRATEGIES)
def test_stateful_ws4(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """... on four ranks (small units leave some ranks with empty shards)."""
    return stateful_row(ctx, impl, case_settings)


#: A program using every control of a ``fully_shard``-ed module ([Note: fully_shard programs]): prefetch lists;
#: a backward without gradient sync, then one with it (after an asynchronous unshard); a backward keeping the
#: unsharded parameters, with a reshard mid-iteration; a step after it; an unshard of the root.
CONTROLS_PROGRAM = Program(
    config=FullyShardConfig(world_size=2, model=ModelSpec(blocks=(Block(), Block())), wrap=("blocks.0", "blocks.1"),
                            reshard_after_forward=False),
    ops=(Prefetch(), GradSync(), Forward(), Backward(), GradSync(on=True),
         Unshard(unit="blocks.1", async_op=True, batch=1), Backward(), Step(), ReshardAfterBackward(), Forward(),
         Reshard(unit="blocks.0"), Backward(), Step(), Unshard(), Backward()),
)


@case("fuzz/fully_shard_controls", clause=("C1", "C3", "C11"), world_size=TWO_OR_MORE,
      requires=[Capability.FULLY_SHARD, Capability.FULLY_SHARD_CONTROLS, Capability.EXPLICIT_PREFETCH],
      uses=NEIGHBOURS_USE)
def test_fully_shard_controls(ctx: RankContext, impl: FSDPAdapter) -> None:
    """On a ``fully_shard``-ed model, explicit prefetch, ``unshard()`` (also asynchronous), ``reshard()``
    mid-iteration, ``set_reshard_after_backward(False)`` and a backward without gradient sync change no value:
    outputs, losses, parameters and (after the synchronizing backward) gradients stay the shadow model's."""
    run_program(ctx, impl, CONTROLS_PROGRAM.at_world_size(ctx.world_size))


_TWO_UNITS = FullyShardConfig(world_size=2, model=ModelSpec(blocks=(Block(), Block())), wrap=("blocks.0", "blocks.1"))
#: Resharding after forward off everywhere (an iteration, a forward left gathered), back on for one unit, then all.
RESHARD_AFTER_FORWARD_PROGRAM = Program(_TWO_UNITS, (
    SetReshardAfterForward(), Train(), Forward(grad=False), Train(batch=1),
    SetReshardAfterForward(unit="blocks.1", on=True, recurse=False), Train(), SetReshardAfterForward(on=True), Train()))
#: Divide factors on the root and a unit, also over a backward without gradient sync.
DIVIDE_FACTOR_PROGRAM = Program(_TWO_UNITS, (
    GradientDivideFactor(factor=4.0), Train(), GradientDivideFactor(factor=1.0, unit="blocks.1"), Train(batch=1),
    GradSync(), Train(), GradientDivideFactor(factor=4.0, unit="blocks.1"), GradSync(on=True), Train()))


@case("fuzz/set_reshard_after_forward", clause=("C1", "C11"), world_size=TWO_OR_MORE, uses=NEIGHBOURS_USE,
      requires=[Capability.FULLY_SHARD, Capability.SET_RESHARD_AFTER_FORWARD])
def test_set_reshard_after_forward(ctx: RankContext, impl: FSDPAdapter) -> None:
    """``set_reshard_after_forward`` off and on again changes no value, and a unit it turns off is not gathered
    again in backward and may stay gathered after a forward, no more."""
    run_program(ctx, impl, RESHARD_AFTER_FORWARD_PROGRAM.at_world_size(ctx.world_size))


@case("fuzz/gradient_divide_factor", clause=("C2", "C11"), world_size=TWO_OR_MORE, uses=NEIGHBOURS_USE,
      requires=[Capability.FULLY_SHARD, Capability.GRADIENT_DIVIDE_FACTOR, Capability.FULLY_SHARD_CONTROLS])
def test_gradient_divide_factor(ctx: RankContext, impl: FSDPAdapter) -> None:
    """After ``set_gradient_divide_factor(f)`` a module's own parameters get the sum of the ranks' gradients
    over ``f`` (what backwards without sync kept included), its other modules' the mean."""
    run_program(ctx, impl, DIVIDE_FACTOR_PROGRAM.at_world_size(ctx.world_size))


# -- reproducers the stateful fuzzer found ----------------------------------------------------------------

# Found by the stateful fuzzer (seed 0, 40 programs, world sizes 2 and 4; simplified by hand to one rank and one
# scale layer) in torch-fsdp1: with buffer_dtype=bfloat16 a full state dict taken before any forward holds the
# buffers rounded to bfloat16 (docs/findings/fsdp1-buffer-dtype-rounds-saved-buffers.md).
@case("fuzz/repro_buffer_dtype_state_dict_before_forward", clause=("C13", "C4"), world_size=ONE_RANK_BF16,
      requires=[Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE], uses=NEIGHBOURS_USE)
def test_repro_buffer_dtype_state_dict_before_forward(ctx: RankContext, impl: FSDPAdapter) -> None:
    """With ``buffer_dtype=bfloat16``, a full state dict taken right after wrapping, before any forward,
    holds the buffers at their full-precision values, as the shadow model's."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=1, model=ModelSpec(blocks=(Block(layers=("scale",)),)),
                                                 policy=Policy(buffer_dtype="bfloat16")), ops=(Save(optim=False),)))


# Found by the stateful fuzzer (seed 0, 40 programs, world size 2) in torch-fsdp1: a no_grad forward between
# backward and the optimizer step leaves the root's pre-step parameters unsharded, and the next forward and
# summon_full_params use them (docs/findings/fsdp1-no-grad-forward-before-step-stale-params.md).
@case("fuzz/repro_no_grad_forward_before_step", clause=("C1", "C11"), world_size=TWO_OR_MORE, uses=NEIGHBOURS_USE)
def test_repro_no_grad_forward_before_step(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A ``no_grad`` forward between backward and the optimizer step does not keep the pre-step
    parameters: after the step the full parameters and the next forward equal the shadow's."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=ctx.world_size),
                                   ops=(Forward(), Backward(), Forward(grad=False), Step())))


# Found by the stateful fuzzer (seed 0, 40 programs, world size 2) in torch-fsdp2: with reshard_after_forward=False
# a no_grad forward after backward leaves the unsharded parameters registered, without gradients, and the next
# forward after a step uses the pre-step values (docs/findings/fsdp2-no-grad-forward-unsharded-params.md).
@case("fuzz/repro_no_grad_forward_unsharded_params", clause=("C1", "C11"), world_size=TWO_OR_MORE,
      strategies=("SHARD_GRAD_OP",), uses=NEIGHBOURS_USE)
def test_repro_no_grad_forward_unsharded_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    """With SHARD_GRAD_OP (``reshard_after_forward=False``), a ``no_grad`` forward after backward keeps
    the gradients the user sees and the next forward uses the stepped parameters, as the shadow's."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=ctx.world_size, strategy="SHARD_GRAD_OP"),
                                   ops=(Forward(), Backward(), Forward(grad=False))))


# Found by the stateful fuzzer (seed 0, 40 programs, world size 4; the same program on two ranks) in torch-fsdp2:
# a full optimizer state dict saved before the first step cannot be loaded (set_optimizer_state_dict raises
# "Expected device to be set"); torch.distributed.checkpoint.state_dict's, documented
# (docs/findings/dcp-full-optim-load-with-grads-before-first-step.md).
@case("fuzz/repro_full_optim_load_before_first_step", clause="C4", world_size=TWO_OR_MORE,
      requires=[Capability.FULL_STATE_DICT], uses=NEIGHBOURS_USE)
def test_repro_full_optim_load_before_first_step(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A full model and optimizer state dict saved before the first optimizer step loads back, and
    the state then equals the shadow's."""
    run_program(ctx, impl, Program(WrapConfig(world_size=ctx.world_size), (Forward(), Backward(), Save(), Load())))


# Found by the stateful fuzzer (seeds 0-3, 40 programs, world size 2; shrunk by hand to one unit and no optimizer
# save) in the reference: a full state dict between forward and backward left the units gathering in full
# precision, and backward raised (setStorage: "storage of size 0"). torch-fsdp1 and torch-fsdp2 pass.
@case("fuzz/repro_full_state_dict_mid_iteration_bf16", clause=("C4", "C13"), uses=NEIGHBOURS_USE,
      requires=[Capability.MIXED_PRECISION, Capability.FULL_STATE_DICT],
      world_size=Exact(2, reason="a bfloat16 reduction has one correct value at 2 ranks only"))
def test_repro_full_state_dict_mid_iteration_bf16(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Under a bfloat16 policy, a full state dict taken between forward and backward holds the shadow's
    values, and the backward that follows runs and gives the shadow's gradients."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=2, policy=Policy()),
                                   ops=(Forward(), Save(optim=False), Backward())))


# Found by the stateful fuzzer (seeds 0-3, 40 programs; shrunk by hand to one rank and one checkpointed scale
# layer) in the reference: a full state dict after a forward held the buffers of an activation-checkpointed block
# in the buffer dtype (bfloat16), not in the dtype they were built in. torch-fsdp1 passes.
@case("fuzz/repro_buffer_dtype_checkpointed_state_dict", clause=("C4", "C13"), world_size=ONE_RANK_BF16,
      requires=[Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE, Capability.FULL_STATE_DICT],
      uses=NEIGHBOURS_USE)
def test_repro_buffer_dtype_checkpointed_state_dict(ctx: RankContext, impl: FSDPAdapter) -> None:
    """With ``buffer_dtype=bfloat16``, a full state dict after a forward holds the buffers of an
    activation-checkpointed block in float32, the dtype they were built in (as the shadow's)."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=1, model=ModelSpec(blocks=(Block(layers=("scale",)),)),
                                                 policy=Policy(buffer_dtype="bfloat16"), checkpoint=("blocks.0",)),
                                   ops=(Forward(), Save(optim=False))))


# Found by the stateful fuzzer (seed 3, 40 programs, world size 2; shrunk by hand to one block) in the reference:
# a sharded state dict between forward and backward left a flat-parameter unit's modules without their parameter
# attributes, and the recomputation of a checkpointed block in backward raised ("'Linear' object has no attribute
# 'weight'"). torch-fsdp1 passes.
@case("fuzz/repro_sharded_state_dict_before_recompute", clause=("C4", "C17"), world_size=TWO_OR_MORE,
      requires=[Capability.SHARDED_STATE_DICT], uses=NEIGHBOURS_USE)
def test_repro_sharded_state_dict_before_recompute(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A sharded state dict taken between forward and backward leaves the backward that follows (recomputing
    an activation-checkpointed block) running, with the shadow's gradients."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=ctx.world_size, checkpoint=("blocks.0",)),
                                   ops=(Forward(), Save(sharded=True, optim=False), Backward())))


# Found by the stateful fuzzer (seed 0, 20 programs, world size 1) in the shadow model, which failed every
# implementation, the reference included: it reduced the backward inside no_sync and the next one separately and
# added the results in float32, where each rank's sum is rounded to the param dtype before the one reduction
# ([Note: unsynced accumulation dtype] in conformance/fuzz/shadow.py).
@case("fuzz/repro_no_sync_bf16_accumulation", clause=("C3", "C13"), world_size=ONE_RANK_BF16,
      requires=[Capability.MIXED_PRECISION, Capability.NO_SYNC], uses=NEIGHBOURS_USE)
def test_repro_no_sync_bf16_accumulation(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Under bfloat16 params and reduction, a backward inside ``no_sync`` and the next one: the gradient is their
    sum rounded to bfloat16 and reduced once, and the parameters after the step equal the shadow's."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=1, model=ModelSpec(blocks=(Block(), Block())),
                                                 use_orig_params=True, policy=Policy()), ops=(NoSync(), Step())))


# Written from the program above with reduce_dtype=float32 on two ranks: torch-fsdp2 (whose no_sync is
# set_requires_gradient_sync(False)) keeps the unsynced gradient in float32, where FSDP1's no_sync keeps it in
# bfloat16 (docs/findings/fsdp2-no-sync-accumulates-in-reduce-dtype.md).
@case("fuzz/repro_no_sync_float32_reduce_accumulation", clause=("C3", "C13"), world_size=TWO_OR_MORE,
      requires=[Capability.MIXED_PRECISION, Capability.NO_SYNC], uses=NEIGHBOURS_USE)
def test_repro_no_sync_float32_reduce_accumulation(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Under bfloat16 params and a float32 reduction, a backward inside ``no_sync`` and the next one: each rank's
    sum is kept in bfloat16 (FSDP1's ``no_sync``) and reduced once in float32; gradients and parameters after the
    step equal the shadow's."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=ctx.world_size,
                                                     model=ModelSpec(blocks=(Block(), Block())),
                                                     use_orig_params=True, policy=Policy(reduce_dtype="float32")),
                                   ops=(NoSync(), Step())))


# Found by the stateful fuzzer (seed 0, 20 programs, world size 4, HYBRID_SHARD; the strategy does not matter, so
# shrunk by hand to the default configuration on two ranks) in torch-fsdp2: taking the optimizer state dict before
# the first step runs a step on zero gradients, which counts for Adam, so the first real step is its second
# (torch.distributed.checkpoint.state_dict's; docs/findings/dcp-optim-state-dict-steps-adam.md).
@case("fuzz/repro_optim_state_dict_before_first_step_adam", clause="C4", world_size=TWO_OR_MORE,
      requires=[Capability.FULL_STATE_DICT, Capability.OPTIM_STATE_DICT], uses=NEIGHBOURS_USE)
def test_repro_optim_state_dict_before_first_step_adam(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Saving the model and Adam's state before the first step changes nothing: the first training
    iteration after it leaves the parameters the shadow's."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=ctx.world_size, optimizer="adam"),
                                   ops=(Save(), Train())))


# Written by hand from FSDP1's clip_grad_norm_, which the stateful fuzzer's ClipGradNorm reaches in a float64
# wrap program on two or more ranks: with a sharded strategy it takes every local norm in float32, which
# torch's vector_norm refuses for a float64 gradient (docs/findings/fsdp1-clip-grad-norm-float64.md).
@case("fuzz/repro_clip_grad_norm_float64", clause="C19", world_size=TWO_OR_MORE,
      requires=[Capability.WRAPPER_METHODS], uses=NEIGHBOURS_USE)
def test_repro_clip_grad_norm_float64(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Clipping a float64 model's gradients after one backward returns the shadow's total norm and leaves its
    clipped gradients."""
    run_program(ctx, impl, Program(config=WrapConfig(world_size=ctx.world_size, dtype="float64"),
                                   ops=(Forward(), Backward(), ClipGradNorm())))


# Written by hand as the smallest program with a reentrant block ([Note: reentrant blocks] in
# conformance.fuzz.drawing) that needs the root's parameters after the nested backward: torch-fsdp1 with a
# sharded strategy frees the root's unsharded parameters when the nested backward delivers its piece of the root's
# gradient, and the outer backward through blocks.0 then reads freed storage
# (docs/findings/fsdp1-reentrant-checkpoint-frees-unit.md).
@case("fuzz/repro_reentrant_checkpoint_root_params", clause=("C17", "C1"), world_size=TWO_OR_MORE, uses=NEIGHBOURS_USE)
def test_repro_reentrant_checkpoint_root_params(ctx: RankContext, impl: FSDPAdapter) -> None:
    """A block of the root unit checkpointing itself reentrantly, after a block whose backward needs the root's
    parameters (its input, the embedding's output, needs a gradient): one training iteration equals the shadow's."""
    model = ModelSpec(vocab=7, blocks=(Block(), Block(reentrant=True)))
    run_program(ctx, impl, Program(config=WrapConfig(world_size=ctx.world_size, model=model), ops=(Train(),)))


# Found by the stateful fuzzer (seed 0, 20 programs, one rank; shrunk to GradSync(), Train(),
# GradientDivideFactor(2.0) on float64 parameters) in torch-fsdp2, and written by hand with the float16 reduction
# a user's mixed precision has: at a sharding degree of one FSDP2 divides by the factor twice wherever it splits the
# division around the reduction (docs/findings/fsdp2-divide-factor-twice-at-one-rank.md).
@case("fuzz/repro_divide_factor_one_rank", clause=("C2", "C13"),
      world_size=Exact(1, reason="a sharding degree of one, where FSDP2 skips the reduce-scatter"),
      requires=[Capability.FULLY_SHARD, Capability.GRADIENT_DIVIDE_FACTOR, Capability.FULLY_SHARD_MIXED_PRECISION],
      uses=NEIGHBOURS_USE)
def test_repro_divide_factor_one_rank(ctx: RankContext, impl: FSDPAdapter) -> None:
    """On one rank, reducing in float16, ``set_gradient_divide_factor(2.0)`` halves the gradient once: a
    training iteration leaves the shadow's parameters (its gradient over the factor, stepped)."""
    config = FullyShardConfig(world_size=1, policy=Policy(param_dtype="float16"))  # reducing in float16
    run_program(ctx, impl, Program(config=config, ops=(GradientDivideFactor(factor=2.0), Train())))
