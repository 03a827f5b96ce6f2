"""fuzz: the parity fuzzer as matrix rows, one per world size (see :mod:`conformance.cases.fuzz`).

Each row draws ``--fuzz-examples`` (``FSDP_FUZZ_EXAMPLES``) examples (default:
12, 15 and 3 for world sizes 1, 2 and 4; a nightly run raises it) from
``--fuzz-seed`` (``FSDP_FUZZ_SEED``, default 0), runs each on the
implementation and on a local baseline, and on a mismatch fails with the
shrunk example printed as a ready-to-paste case. Paste reproducers below the
rows; they run against every implementation like any case (one with a
mixed-precision policy requires the capabilities the policy needs).

A fifth to a third of the examples draw a mixed-precision policy
(``conformance.cases.fuzz.precision``; gradients reduced in low precision only where
that has one correct value, [Note: low-precision reductions in the fuzzer]).
For an implementation without ``Capability.MIXED_PRECISION`` (or without
``MP_BUFFER_DTYPE``) the drawn policy (or its buffer dtype) is dropped: the
example still runs, in full precision, and the row's reason says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.cases.fuzz.driver import FuzzSettings, fuzz, render_case
from conformance.cases.fuzz.example import Block, Example, ModelSpec, Policy
from conformance.cases.fuzz.precision import precision_note
from conformance.cases.fuzz.runner import run_example
from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.case import CaseSettings, case
from conformance.contract.results import CaseReport

#: What the parity fuzzer draws only where the adapter declares it (precision.precision_features).
_DRAWN = (Capability.MIXED_PRECISION, Capability.MP_BUFFER_DTYPE)

if TYPE_CHECKING:
    from harness import RankContext

def _timeout_s(settings: CaseSettings) -> float:
    """Pool start and three world sizes' worth of examples, each well under a second; shrinking a
    failure runs a few hundred more."""
    return 120.0 + 3.0 * FuzzSettings.of(settings).budget(2)


def _parity(ctx: RankContext, impl: FSDPAdapter, settings: CaseSettings) -> CaseReport:
    config = FuzzSettings.of(settings)
    result = fuzz(ctx, impl, config)
    if result.failing is not None:
        raise AssertionError(
            f"parity fuzzer (seed {config.seed}): {result.message}\n"
            f"minimal reproducer after {result.runs} runs:\n{render_case(result.failing, result.message or '')}"
        )
    note = precision_note(impl)
    policies = note or f"{result.mixed_precision} under a mixed-precision policy"
    return CaseReport(
        reason=f"{config.budget(ctx.world_size)} examples from seed {config.seed} ({policies}), no mismatch",
        metrics={"examples": result.runs, "mixed_precision_examples": result.mixed_precision},
    )


@case("fuzz/parity_ws1", world_size=1, modes=("process",), timeout_s=_timeout_s, uses=_DRAWN)
def test_parity_ws1(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """Random models, wrap plans and training loops on one rank give the local model's losses, grads and params;
    a mismatch fails with a shrunk reproducer."""
    return _parity(ctx, impl, case_settings)


@case("fuzz/parity_ws2", world_size=2, modes=("process",), timeout_s=_timeout_s, uses=_DRAWN)
def test_parity_ws2(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """As ``fuzz/parity_ws1`` on two ranks: losses, grads and params match the local model (uneven shards for
    odd widths)."""
    return _parity(ctx, impl, case_settings)


@case("fuzz/parity_ws4", world_size=4, modes=("process",), timeout_s=_timeout_s, uses=_DRAWN)
def test_parity_ws4(ctx: RankContext, impl: FSDPAdapter, case_settings: CaseSettings) -> CaseReport:
    """As ``fuzz/parity_ws1`` on four ranks: losses, grads and params match the local model (small units leave
    some ranks with empty shards)."""
    return _parity(ctx, impl, case_settings)


# -- reproducers the fuzzer found ---------------------------------------------------------------

# Found by the parity fuzzer (seed 1) in torch-fsdp1: after backward the unused unit's parameters are
# missing from the module (docs/findings/fsdp1-no-shard-unused-unit-params.md).
@case("fuzz/repro_8fc450e8", world_size=1)
def test_repro_8fc450e8(ctx: RankContext, impl: FSDPAdapter) -> None:
    """One rank, use_orig_params: a unit the forward never uses keeps its parameters registered on the
    module after backward, and losses, grads and params after each step match the local model."""
    run_example(ctx, impl, Example(world_size=1, model=ModelSpec(blocks=(Block(inner=("linear",)),), unused=True),
                                   wrap=("unused",), use_orig_params=True))


# Found by the parity fuzzer (seed 1, world size 4) in torch-fsdp1: a rank died (gloo: "Received data size
# doesn't match expected size") reading full gradients of a float64 unit whose last shard is padding only
# (docs/findings/fsdp1-summon-grads-float64-padding-shard.md). Written by hand from the finding: a crash
# cannot be shrunk. On thread ranks torch-fsdp1 hangs instead of dying; the timeout leaves room for a fresh
# pool of four ranks warming up on a loaded 2-core machine (about 30 s), not for the default 120 s.
@case("fuzz/repro_d61e5cb1", world_size=4, timeout_s=90.0)
def test_repro_d61e5cb1(ctx: RankContext, impl: FSDPAdapter) -> None:
    """Four ranks, a float64 unit whose last rank's shard is padding only: reading its full gradients
    works on every rank (no rank dies or hangs), and losses, grads and params match the local model."""
    run_example(ctx, impl, Example(world_size=4, wrap=("blocks.0",), use_orig_params=True, dtype="float64"))


# Found by the parity fuzzer (seed 0, 60 examples) in torch-fsdp1: with a bfloat16 reduction, NO_SHARD (what
# FSDP1 runs at world size 1) adds a second backward's gradient to the first in bfloat16, where the sharded
# strategies add in float32 (docs/findings/fsdp1-no-shard-low-precision-accumulation.md).
@case("fuzz/repro_57555c45", world_size=1, requires=[Capability.MIXED_PRECISION])
def test_repro_57555c45(ctx: RankContext, impl: FSDPAdapter) -> None:
    """One rank, bfloat16 params and reduction, two backwards per step: outputs come out in bfloat16, and
    losses, grads (each backward's reduced gradient added to the float32 one, not summed in bfloat16) and
    params match the local mixed-precision baseline."""
    run_example(ctx, impl, Example(world_size=1, policy=Policy(), micro_batches=2))
