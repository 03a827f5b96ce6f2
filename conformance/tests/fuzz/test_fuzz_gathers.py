"""The stateful fuzzer's check of backward's all-gathers ([Note: all-gathers in backward] in fuzz/gathers.py)."""

from __future__ import annotations

import re

import pytest

from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.contract.adapter import FSDPAdapter
from conformance.fuzz.example import Block, ModelSpec
from conformance.fuzz.gathers import promise
from conformance.fuzz.ops import Backward, Forward, FullyShardConfig, Program, Train, WrapConfig
from conformance.selftest.mutants import NoBackwardPrefetch, RegroupsGivenGroups, ReshardIntAsFalse, Zero2AsHybridShard
from harness import RankContext, run

_MODEL = ModelSpec(width=4, blocks=(Block(("linear", "linear")), Block()), unused=True)
_UNITS = ("blocks.0", "blocks.1", "unused")
#: A plain iteration, then one whose loss sums two forwards (not judged: see the note), then one more.
_OPS = (Train(), Forward(), Forward(batch=1), Backward(), Train(batch=2))
_INT = Program(FullyShardConfig(world_size=4, model=_MODEL, wrap=_UNITS, reshard_after_forward=2,
                      checkpoint=("blocks.1",)), _OPS)
_KEEP = Program(FullyShardConfig(world_size=2, model=_MODEL, wrap=_UNITS, reshard_after_forward=False), _OPS)
_ZERO2 = Program(WrapConfig(world_size=4, model=_MODEL, wrap=_UNITS, strategy="_HYBRID_SHARD_ZERO2"), _OPS)
_HYBRID = Program(WrapConfig(world_size=4, model=_MODEL, wrap=_UNITS, strategy="HYBRID_SHARD", use_orig_params=True),
                  _OPS)
_FULL = Program(WrapConfig(world_size=2, model=_MODEL, wrap=_UNITS, checkpoint=("blocks.1",)), _OPS)
_SGO = Program(WrapConfig(world_size=2, model=_MODEL, wrap=_UNITS, strategy="SHARD_GRAD_OP", use_orig_params=True,
                      checkpoint=("blocks.0",)), _OPS)


def test_what_resharding_promises() -> None:
    assert promise(_INT.config) == 2 and promise(_KEEP.config) == "none" and promise(_ZERO2.config) == "none"
    assert promise(FullyShardConfig(world_size=2)) is None  # resharding: backward gathers what it needs
    assert promise(WrapConfig(world_size=1, strategy="SHARD_GRAD_OP")) is None  # nothing to gather on one rank
    assert promise(WrapConfig(world_size=2, strategy="FULL_SHARD")) is None


def _verdicts(ctx: RankContext, impl: FSDPAdapter, program: Program) -> str | None:
    """The program's own verdict (its neighbours have tests of their own: test_fuzz_neighbours.py)."""
    from conformance.fuzz.stateful import check_program

    return check_program(ctx, impl, program, neighbours=False)


@pytest.mark.parametrize(("impl", "program"), [
    (ReferenceAdapter(), _INT), (TorchFSDP2Adapter(), _INT), (ReferenceAdapter(), _KEEP), (TorchFSDP2Adapter(), _KEEP),
    (ReferenceAdapter(), _ZERO2), (TorchFSDP1Adapter(), _ZERO2), (ReferenceAdapter(), _HYBRID),
    (TorchFSDP1Adapter(), _HYBRID), (ReferenceAdapter(), _SGO), (TorchFSDP1Adapter(), _SGO),
    (ReferenceAdapter(), _FULL), (TorchFSDP1Adapter(), _FULL), (TorchFSDP2Adapter(), _FULL),
], ids=["reference-int", "torch-fsdp2-int", "reference-keep", "torch-fsdp2-keep", "reference-zero2",
        "torch-fsdp1-zero2", "reference-hybrid", "torch-fsdp1-hybrid", "reference-sgo",
        "torch-fsdp1-sgo", "reference-full", "torch-fsdp1-full", "torch-fsdp2-full"])
def test_the_reference_and_torch_keep_the_promise(impl: FSDPAdapter, program: Program) -> None:
    """Every operation passes, the all-gathers included. torch-fsdp1 then fails the program's end on its
    registered finding (docs/findings/fsdp1-abandoned-forward-keeps-model.md: the ``unused`` unit's forward
    ran with gradients and its backward never did), which is checked only after every operation passed."""
    got = run(_verdicts, world_size=program.config.world_size, mode="process", timeout_s=240, args=(impl, program))
    if isinstance(impl, TorchFSDP1Adapter) and got[0] is not None:
        assert got[0].startswith("rank 0: memory held: the wrapped model, dropped at the program's end"), got[0]
        return
    assert got[0] is None, got[0]


@pytest.mark.parametrize(("mutant", "program", "message"), [
    (ReshardIntAsFalse(), _INT, r"groups of \[\] ranks, though reshard_after_forward=2 keeps"),
    (Zero2AsHybridShard(), _ZERO2, r"groups of \[2, 2\] ranks, though _HYBRID_SHARD_ZERO2 keeps the unsharded"),
    (NoBackwardPrefetch(), _FULL, r"all-gather, reduce-scatter, all-gather, .*: the second all-gather only after"),
    (RegroupsGivenGroups(), _HYBRID, r"over groups .* \(ranks \[0, 1\]\), not the shard group object given"),
], ids=["reshard-int-as-false", "zero2-as-hybrid-shard", "no-backward-prefetch", "regroups-given-groups"])
def test_mutants_that_gather_otherwise_fail(mutant: FSDPAdapter, program: Program, message: str) -> None:
    """Same values, other communication: only the all-gathers show it (fresh rank processes: a mutant's patches
    stay where it ran)."""
    got = run(_verdicts, world_size=program.config.world_size, mode="process", timeout_s=240, isolated=True,
              args=(mutant, program))[0]
    assert got is not None and got.startswith("op 0 (Train(batch=0)), rank 0: all-gathers in backward:"), got
    assert re.search(message, got), got
