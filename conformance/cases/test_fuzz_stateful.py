"""fuzz: the stateful fuzzer as matrix rows, one per world size (see :mod:`conformance.cases.fuzz.stateful`).

Each row draws ``--fuzz-stateful-examples`` (``FSDP_FUZZ_STATEFUL_EXAMPLES``)
programs (default: 5, 5 and 2 at world sizes 1, 2 and 4; a nightly run raises
it) from ``--fuzz-seed``: a configuration (strategy, ``use_orig_params``,
mixed precision, CPU offload, activation checkpointing, frozen and tied
parameters) and a random sequence of a user's operations on the wrapped model
([Note: stateful programs] in :mod:`conformance.cases.fuzz.ops`). Every
operation runs on the implementation and on a local shadow model, and the
user-visible state must agree after each one ([Note: stateful invariant]). A
mismatch fails with the shrunk program printed as a ready-to-paste case; paste
reproducers below the rows.

What the adapter cannot express is left out and said in the row's reason:
configuration features are dropped after drawing (as the parity fuzzer drops a
policy), and operations it lacks (``no_sync``, state dicts a rank mode cannot
take) are skipped on both sides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.cases.fuzz.example import Block, ModelSpec, Policy
from conformance.cases.fuzz.ops import FEATURES, Backward, Config, Forward, Load, Program, Save, Step
from conformance.cases.fuzz.stateful import (
    budget,
    features_of,
    missing_operations,
    render_program,
    run_program,
    stateful_fuzz,
)
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import CaseSettings, case
from conformance.contract.results import CaseReport

if TYPE_CHECKING:
    from harness import RankContext


def _timeout_s(settings: CaseSettings) -> float:
    """Pool start and the budget's programs, each a second or two at world size 4 on two loaded cores;
    shrinking a failure runs a few hundred more."""
    return 120.0 + 5.0 * budget(settings, 4)


def _stateful(ctx: RankContext, impl: FSDPAdapter, settings: CaseSettings) -> CaseReport:
    result = stateful_fuzz(ctx, impl, settings)
    if result.failing is not None:
        raise AssertionError(
            f"stateful fuzzer (seed {settings.fuzz_seed}): {result.message}\n"
            f"minimal reproducer after {result.runs} runs:\n{render_program(result.failing, result.message or '')}"
        )
    missing = missing_operations(impl, ctx.mode)
    dropped = sorted(FEATURES - features_of(impl))
    notes = [f"skipped {op} ({reason})" for op, reason in missing.items()]
    notes += [f"not drawn: {', '.join(dropped)}"] * bool(dropped)
    return CaseReport(
        reason=f"{budget(settings, ctx.world_size)} programs ({result.counted} operations) from seed "
               f"{settings.fuzz_seed}, no mismatch" + "".join(f"; {note}" for note in notes),
        metrics={"programs": result.runs, "operations": result.counted},
    )


#: What the stateful fuzzer draws only where the adapter declares it (stateful.features_of).
_DRAWN = (Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE, Capability.CPU_OFFLOAD)


@case("fuzz/stateful_ws1", world_size=1, timeout_s=_timeout_s, uses=_DRAWN)
def test_stateful_ws1(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """Random sequences of a user's operations on one rank keep the wrapped model equal to the shadow."""
    return _stateful(ctx, impl, case_settings)


@case("fuzz/stateful_ws2", world_size=2, timeout_s=_timeout_s, uses=_DRAWN)
def test_stateful_ws2(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """... on two ranks (gradients averaged over them)."""
    return _stateful(ctx, impl, case_settings)


@case("fuzz/stateful_ws4", world_size=4, timeout_s=_timeout_s, uses=_DRAWN)
def test_stateful_ws4(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """... on four ranks (small units leave some ranks with empty shards)."""
    return _stateful(ctx, impl, case_settings)


# -- reproducers the stateful fuzzer found ----------------------------------------------------------------

# Found by the stateful fuzzer (seed 0, 40 programs, world sizes 2 and 4; simplified by hand to one rank and one
# scale layer) in torch-fsdp1: with buffer_dtype=bfloat16 a full state dict taken before any forward holds the
# buffers rounded to bfloat16 (docs/findings/fsdp1-buffer-dtype-rounds-saved-buffers.md).
@case("fuzz/repro_6ec378a7", world_size=1, requires=[Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE])
def test_repro_6ec378a7(ctx: RankContext, impl: FSDPAdapter) -> None:
    run_program(ctx, impl, Program(config=Config(world_size=1, model=ModelSpec(blocks=(Block(layers=("scale",)),)),
                                                 policy=Policy(buffer_dtype="bfloat16")), ops=(Save(optim=False),)))


# Found by the stateful fuzzer (seed 0, 40 programs, world size 2) in torch-fsdp1: a no_grad forward between
# backward and the optimizer step leaves the root's pre-step parameters unsharded, and the next forward and
# summon_full_params use them (docs/findings/fsdp1-no-grad-forward-before-step-stale-params.md).
@case("fuzz/repro_438854a6", world_size=2)
def test_repro_438854a6(ctx: RankContext, impl: FSDPAdapter) -> None:
    run_program(ctx, impl, Program(config=Config(world_size=2), ops=(Forward(), Backward(), Forward(grad=False),
                                                                    Step())))


# Found by the stateful fuzzer (seed 0, 40 programs, world size 2) in torch-fsdp2: with reshard_after_forward=False
# a no_grad forward after backward leaves the unsharded parameters registered, without gradients, and the next
# forward after a step uses the pre-step values (docs/findings/fsdp2-no-grad-forward-unsharded-params.md).
@case("fuzz/repro_3ff502a0", world_size=2, strategies=("SHARD_GRAD_OP",))
def test_repro_3ff502a0(ctx: RankContext, impl: FSDPAdapter) -> None:
    run_program(ctx, impl, Program(config=Config(world_size=2, strategy="SHARD_GRAD_OP"),
                                   ops=(Forward(), Backward(), Forward(grad=False))))


# Found by the stateful fuzzer (seed 0, 40 programs, world size 4; the same program on two ranks) in torch-fsdp2:
# a full optimizer state dict saved before the first step cannot be loaded (set_optimizer_state_dict raises
# "Expected device to be set") (docs/findings/fsdp2-full-optim-load-before-first-step.md).
@case("fuzz/repro_49d9e993", world_size=2, requires=[Capability.FULL_STATE_DICT])
def test_repro_49d9e993(ctx: RankContext, impl: FSDPAdapter) -> None:
    run_program(ctx, impl, Program(config=Config(world_size=2), ops=(Forward(), Backward(), Save(), Load())))
