"""What a stateful program reaches without a draw of its own: units recomputed first ([Note: units recomputed
first] in fuzz/drawing.py) and a program's closing iteration ([Note: fully_shard programs] in fuzz/controls.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from conformance.adapters.reference import ReferenceAdapter
from conformance.fuzz.example import Block, ModelSpec
from conformance.fuzz.ops import FullyShardConfig, GradSync, Program, Train, WrapConfig
from conformance.fuzz.stateful import check_program
from conformance.selftest.mutants import GradSyncForgetsKeptGrads, NoRegatherForRecompute
from conformance.tests.fuzz.test_fuzz_stateful import _drawn
from harness import run

#: A checkpointed block whose nested block, run first, is a unit freed after forward: recomputing the block in
#: backward runs the unit's forward before the unit's own backward has gathered it.
_RECOMPUTED = Program(
    WrapConfig(world_size=2, model=ModelSpec(width=4, blocks=(Block(inner=("linear",), inner_first=True),)),
           wrap=("blocks.0.inner",), checkpoint=("blocks.0",)),
    (Train(),))
#: A backward with gradient sync off, and nothing after it: the closing iteration reduces what it kept.
_UNSYNCED = Program(FullyShardConfig(world_size=2, wrap=("blocks.0",)), (GradSync(on=False), Train()))


def test_checkpointed_blocks_run_their_nested_unit_first() -> None:
    """Exactly the checkpointed blocks whose nested block is a unit run it first, for both APIs."""
    drawn = [*_drawn(3, 100), *_drawn(3, 100, world_size=4)]
    for program in drawn:
        config = program.config
        got = tuple(f"blocks.{i}" for i, block in enumerate(config.model.blocks) if block.inner_first)
        want = tuple(path for path in (f"blocks.{i}" for i in range(len(config.model.blocks)))
                     if path in config.checkpoint and f"{path}.inner" in config.wrap)
        assert got == want, (config, got, want)
    assert {p.config.api for p in drawn if any(b.inner_first for b in p.config.model.blocks)} == {"wrap", "fully_shard"}


def test_a_nested_block_first_needs_one() -> None:
    with pytest.raises(ValueError, match=r"Block\(inner_first=True\) needs a nested block"):
        Block(inner_first=True)


@pytest.mark.parametrize(("mutant", "program", "message"), [
    (NoRegatherForRecompute(), _RECOMPUTED, r"op 0 \(Train\(batch=0\)\), rank 0: raised: RuntimeError: setStorage"),
    (GradSyncForgetsKeptGrads(), _UNSYNCED, r"closing op 1 \(Train\(batch=0\)\), rank 0: params: params\["),
], ids=["no-regather-for-recompute", "grad-sync-forgets-kept-grads"])
def test_the_reference_passes_what_its_mutant_fails(mutant: Any, program: Program, message: str) -> None:
    """The program fails on the mutant (fresh rank processes: a mutant's patches stay where it ran) where it
    must, and the reference passes it in both rank modes."""
    got = run(check_program, world_size=2, mode="process", timeout_s=120, isolated=True, args=(mutant, program))
    assert got[0] is not None and re.match(message, got[0]), got
    for mode in ("thread", "process"):
        assert run(check_program, world_size=2, mode=mode, timeout_s=120,
                   args=(ReferenceAdapter(), program)) == [None, None]
