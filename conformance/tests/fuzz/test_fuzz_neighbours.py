"""The neighbours of a stateful program's configuration ([Note: neighbours of a configuration] in
fuzz/neighbours.py)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.contract.adapter import FSDPAdapter
from conformance.fuzz.agreement import agree, attempt
from conformance.fuzz.example import Block, ModelSpec, Policy
from conformance.fuzz.neighbours import _neighbours, _refused
from conformance.fuzz.ops import Config, FullyShardConfig, Program, Train, WrapConfig
from conformance.selftest.mutants import (
    AlwaysPrefetch,
    AutoWrapChildrenOnly,
    ChecksEvalForwards,
    EvalInLowPrecision,
    LenientHybridGroups,
    LowPrecisionGradsUpcast,
    MisuseUnchecked,
    NoBackwardPrefetch,
    NoExecOrderCheck,
    NoOptimInBackwardCheck,
    NoPrefetch,
    NoSyncKeepsGradInReduceDtype,
    NoSyncModuleStates,
    PrefetchListReversed,
    SharedAcrossUnitsAccepted,
    SharedAcrossUnitsUnchecked,
    Silent,
    UnsafeSetattrIgnored,
    WarnsEveryIteration,
    Zero2AsHybridShard,
)
from harness import RankContext, run
from harness.ranks.errors import RankFailure

_MODEL = ModelSpec(width=4, blocks=(Block(("linear", "linear")), Block()))
_HYBRID = WrapConfig(world_size=4, model=_MODEL, wrap=("blocks.0",), strategy="HYBRID_SHARD")
_FLAT = WrapConfig(world_size=2, model=_MODEL, wrap=("blocks.0",))
_MIXED = WrapConfig(world_size=2, model=_MODEL, wrap=("blocks.0",),
                    policy=Policy(reduce_dtype="float32", cast_inputs=True))
#: A first block of buffers only: its units gather nothing, so no order is checked (nothing to refuse).
_BUFFERS_ONLY = WrapConfig(world_size=2, model=ModelSpec(blocks=(Block(("scale",)),)))
_ORDERED = WrapConfig(world_size=2, model=_MODEL, strategy="SHARD_GRAD_OP", use_orig_params=True)
_SHARDED = FullyShardConfig(world_size=2, model=_MODEL, wrap=("blocks.0",))
_SHARDED_MIXED = replace(_SHARDED, policy=Policy(reduce_dtype="float32", cast_inputs=True))
#: Four units whose all-gathers differ in size, so their order can be told ([Note: prefetch lists in order]).
_PREFETCHED = FullyShardConfig(world_size=2, model=ModelSpec(width=4, vocab=7,
                                                             blocks=(Block(("linear",)), Block(("conv3",)),
                                                                     Block(("norm",)))),
                     wrap=("blocks.0", "blocks.1", "blocks.2"))
_UNPREFETCHED = WrapConfig(world_size=2, model=_PREFETCHED.model, wrap=_PREFETCHED.wrap)
#: The last unit frozen: the program's own backward gathers it and reduces nothing, so its first two all-gathers
#: come before any reduce-scatter with or without prefetch; the neighbour's copy has nothing frozen.
_LAST_FROZEN = WrapConfig(world_size=2, model=_PREFETCHED.model, wrap=_PREFETCHED.wrap, frozen=("blocks.2",))


#: The neighbours torch's FSDP1 fails on the CPU by a registered finding (conformance/runner/known_findings.json):
#: its name -> what its failure says. docs/findings/tied-weights-across-units.md (sibling units, flat parameters) and
#: docs/findings/fsdp1-sync-module-states-cpu.md.
_FSDP1_FINDINGS = {"tied across units": "a weight tied across two units was accepted and trained as two parameters",
                   "sync_module_states": "which requires them to be on GPU"}


def _each_neighbour(ctx: RankContext, impl: FSDPAdapter, config: Config) -> list[tuple[str, str | None]]:
    """Every neighbour of ``config`` made, each one's failure or ``None`` (the same on every rank)."""
    return [(name, agree(ctx, attempt(name, step)[1])) for name, step in _neighbours(ctx, impl, config)]


@pytest.mark.parametrize(("impl", "config"), [
    (ReferenceAdapter(), _HYBRID), (TorchFSDP1Adapter(), _HYBRID), (ReferenceAdapter(), _FLAT),
    (TorchFSDP1Adapter(), _FLAT), (ReferenceAdapter(), _SHARDED), (TorchFSDP2Adapter(), _SHARDED),
    (ReferenceAdapter(), _ORDERED), (TorchFSDP1Adapter(), _ORDERED), (ReferenceAdapter(), _MIXED),
    (TorchFSDP1Adapter(), _MIXED), (ReferenceAdapter(), _BUFFERS_ONLY), (ReferenceAdapter(), _PREFETCHED),
    (TorchFSDP2Adapter(), _PREFETCHED), (ReferenceAdapter(), _UNPREFETCHED), (TorchFSDP1Adapter(), _UNPREFETCHED),
    (ReferenceAdapter(), _SHARDED_MIXED), (TorchFSDP2Adapter(), _SHARDED_MIXED),
], ids=["reference-hybrid", "torch-fsdp1-hybrid", "reference-flat", "torch-fsdp1-flat", "reference-fully-shard",
        "torch-fsdp2-fully-shard", "reference-order", "torch-fsdp1-order", "reference-mixed", "torch-fsdp1-mixed",
        "reference-buffers-only", "reference-prefetch-lists", "torch-fsdp2-prefetch-lists",
        "reference-no-forward-prefetch", "torch-fsdp1-no-forward-prefetch", "reference-fully-shard-mixed",
        "torch-fsdp2-fully-shard-mixed"])
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_reference_and_torch_refuse(impl: FSDPAdapter, config: Config, mode: str) -> None:
    """Every neighbour passes, but for torch's FSDP1 failing one as its registered finding says."""
    got = run(_each_neighbour, world_size=config.world_size, mode=mode, timeout_s=120, args=(impl, config))
    assert all(outcomes == got[0] for outcomes in got), got
    findings = _FSDP1_FINDINGS if isinstance(impl, TorchFSDP1Adapter) else {}
    failed = [(name, failure) for name, failure in got[0] if failure is not None]
    assert all(name in findings and findings[name] in failure for name, failure in failed), failed


@pytest.mark.parametrize(("mutant", "config", "message"), [
    (LenientHybridGroups(), _HYBRID, "HYBRID_SHARD without groups, a mesh or a policy was accepted"),
    (NoOptimInBackwardCheck(), _FLAT, "an optimizer in backward with flat parameters was accepted"),
    (MisuseUnchecked(), _SHARDED, r"fully_shard on the model's blocks \(an nn.ModuleList\) was accepted"),
    (NoExecOrderCheck(), _ORDERED, "a first forward whose unit order differs across ranks was accepted"),
    (ChecksEvalForwards(), _ORDERED, r"with the same unit order on every rank, an eval forward between iterations: "
                                     r"warned \[.Forward order differs from that of the first iteration"),
    (AutoWrapChildrenOnly(), _FLAT, r"an auto-wrap policy naming FuzzBlock left blocks \['blocks.0', 'blocks.1'\]"),
    (EvalInLowPrecision(), _MIXED, r"an eval forward returned \['torch.bfloat16'\]: eval computes in full precision"),
    # Rank 1 misses its warning mid-sequence while rank 0 has none to miss: judged after the last collective, no hang.
    (Silent(), _ORDERED, r"rank 1: .* in the first iteration after this rank changed order: no warning"),
    (WarnsEveryIteration(), _ORDERED, r"rank 1: .* in the second iteration after a change of order \(warned once"),
    (PrefetchListReversed(), _PREFETCHED, r"forward all-gathered the units in the order \['<root>', 'blocks.1', "
                                          r"'blocks.0', 'blocks.2'\], not \['<root>', 'blocks.0', 'blocks.1', "),
    (AlwaysPrefetch(), _UNPREFETCHED, r"without forward prefetch, units \['blocks.0', 'blocks.1', 'blocks.2'\] were "
                                      r"all-gathered before the forward of the unit before each began"),
    (UnsafeSetattrIgnored(), _FLAT, r"under FSDP_USE_UNSAFE_SETATTR=1 a forward went through modules' "
                                    r"__setattr__ overrides, setting \['Linear.bias', 'Linear.weight'\]"),
    (NoBackwardPrefetch(), _LAST_FROZEN, r"backward issued all-gather, reduce-scatter, all-gather, .*: the second "
                                          r"all-gather only after the first reduce-scatter, so nothing was prefetched"),
    (NoPrefetch(), _LAST_FROZEN, r"the second all-gather only after the first reduce-scatter"),
    (NoSyncModuleStates(), _FLAT, r"wrapped with sync_module_states=True \(each rank's model of another seed\), rank "
                                  r"\d reads full values of \[.*\] other than rank 0's model"),
    (LowPrecisionGradsUpcast(), _MIXED, r"with keep_low_precision_grads=True and reduction in the param dtype "
                                        r"torch.bfloat16, the optimizer's gradients are \['torch.float32'\]"),
    (Zero2AsHybridShard(), _HYBRID, r"neighbour \(keeping form\): AssertionError: backward issued all-gathers "
                                    r"over groups of \[2\] ranks, though _HYBRID_SHARD_ZERO2 keeps the unsharded"),
    (SharedAcrossUnitsUnchecked(), _SHARDED, r"a weight tied across two units was accepted and trained as two "
                                             r"parameters: after a step first.layers.0.weight and second.layers.0"),
    (NoSyncKeepsGradInReduceDtype(), _MIXED, r"neighbour \(unsynced sums\): .* left a gradient other than the "
                                             r"mean over ranks of each rank's sum kept in bfloat16 .* Greatest "
                                             r"relative difference: 0.25"),
], ids=["lenient-hybrid-groups", "no-optim-in-backward-check", "shard-args-unchecked", "no-exec-order-check",
        "checks-eval-forwards", "auto-wrap-children-only", "eval-in-low-precision", "silent", "warns-every-iteration",
        "prefetch-list-reversed", "always-prefetch", "unsafe-setattr-ignored", "no-backward-prefetch", "no-prefetch",
        "no-sync-module-states", "low-precision-grads-upcast", "zero2-as-hybrid-shard",
        "shared-across-units-unchecked", "no-sync-keeps-grad-in-reduce-dtype"])
def test_mutants_fail_a_neighbour(mutant: FSDPAdapter, config: Config, message: str) -> None:
    """The program itself passes, then fails in a neighbour, on every rank, naming what was accepted (fresh rank
    processes: a mutant's patches stay where it ran)."""
    from conformance.fuzz.stateful import check_program

    got = run(check_program, world_size=config.world_size, mode="process", timeout_s=240, isolated=True,
              args=(mutant, Program(config, (Train(),))))
    assert all(text == got[0] for text in got), got
    assert got[0] is not None and got[0].startswith("after its operations, rank "), got[0]
    assert re.search(message, got[0]), got[0]


def test_a_tie_across_sibling_units_unchecked_breaks_the_ranks() -> None:
    """Without the reference's check, the second of two sibling units flattens what the first left of a shared
    weight (this rank's shard): the ranks' all-gathers no longer match and a rank fails (in the tie neighbour;
    gloo aborts the mismatched collective, so no rank is left waiting)."""
    from conformance.fuzz.stateful import check_program

    with pytest.raises(RankFailure):
        run(check_program, world_size=2, mode="process", timeout_s=240, isolated=True,
            args=(SharedAcrossUnitsAccepted(), Program(_FLAT, (Train(),))))


def test_a_refusal_must_raise_the_documented_error() -> None:
    def raises(exc: Exception) -> None:
        raise exc

    _refused("x", ValueError, "needs a group", lambda: raises(ValueError("it needs a group here")))
    with pytest.raises(AssertionError, match=r"x raised ValueError\('other'\), not one saying 'needs a group'"):
        _refused("x", ValueError, "needs a group", lambda: raises(ValueError("other")))
    with pytest.raises(AssertionError, match=r"x raised TypeError\('bad'\), not ValueError"):
        _refused("x", ValueError, "", lambda: raises(TypeError("bad")))
    with pytest.raises(AssertionError, match="x was accepted: the contract refuses it"):
        _refused("x", ValueError, "", lambda: None)


def test_prefetch_order_is_judged_only_where_units_differ_in_size() -> None:
    """Units are told by their all-gathers' sizes: two of one size leave the order unjudged, as do fewer than
    three units (a list of two changes nothing there)."""
    from conformance.fuzz.model import build_model
    from conformance.fuzz.prefetching import _spans

    def spans(config: Config) -> object:
        return _spans(build_model(config.model, 0, torch.float32, torch.device("cpu")), config)

    assert spans(_PREFETCHED) is not None
    model = ModelSpec(width=4, vocab=7, blocks=(Block(), Block(), Block(("norm",))))
    same = FullyShardConfig(world_size=2, model=model, wrap=("blocks.0", "blocks.1", "blocks.2"))
    assert spans(same) is None
    assert spans(FullyShardConfig(world_size=2, model=_PREFETCHED.model, wrap=("blocks.1",))) is None
