"""The stateful fuzzer's search: programs drawn per world size, run and shrunk on every rank
([Note: stateful programs] in :mod:`conformance.fuzz.ops`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.contract.adapter import FSDPAdapter
from conformance.contract.case import CaseSettings
from conformance.fuzz.drawing import programs
from conformance.fuzz.driver import FuzzSettings, Search, search
from conformance.fuzz.example import FUZZ_STRATEGIES
from conformance.fuzz.stateful import check_program
from conformance.fuzz.wrapping import features_of

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["MAIN_JOB_PROGRAMS", "budget", "stateful_fuzz"]

#: Programs per world size in the main job (see docs/PERFORMANCE.md for what they cost).
MAIN_JOB_PROGRAMS = {1: 5, 2: 5, 4: 2}


def budget(settings: CaseSettings, world_size: int) -> int:
    """Programs to draw at ``world_size``: ``--fuzz-stateful-examples`` (``FSDP_FUZZ_STATEFUL_EXAMPLES``),
    else the main job's."""
    given = settings.fuzz_stateful_examples
    return given if given is not None else MAIN_JOB_PROGRAMS.get(world_size, 1)


def stateful_fuzz(ctx: RankContext, impl: FSDPAdapter, settings: CaseSettings) -> Search:
    """Draw, run and shrink programs on every rank (collective; every rank returns rank 0's result)."""
    strategies = [s for s in FUZZ_STRATEGIES if impl.supports_strategy(s)]
    drawn = programs(ctx.world_size, strategies, features_of(impl))
    config = FuzzSettings.of(settings)
    return search(ctx, impl, drawn, check_program, budget=budget(settings, ctx.world_size), config=config,
                  counted=lambda program: len(program.ops))
