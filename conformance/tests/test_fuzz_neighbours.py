"""The neighbours of a stateful program's configuration ([Note: neighbours of a configuration] in
fuzz/neighbours.py)."""

from __future__ import annotations

import re

import pytest
import torch

from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
from conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
from conformance.cases.fuzz.example import Block, ModelSpec, Policy
from conformance.cases.fuzz.neighbours import _refused, check_neighbours
from conformance.cases.fuzz.ops import Config, Program, Train
from conformance.contract.adapter import FSDPAdapter
from conformance.selftest.mutants import (
    AlwaysPrefetch,
    AutoWrapChildrenOnly,
    ChecksEvalForwards,
    EvalInLowPrecision,
    LenientHybridGroups,
    MisuseUnchecked,
    NoExecOrderCheck,
    NoOptimInBackwardCheck,
    PrefetchListReversed,
    Silent,
    UnsafeSetattrIgnored,
    WarnsEveryIteration,
)
from harness import RankContext, run

_MODEL = ModelSpec(width=4, blocks=(Block(("linear", "linear")), Block()))
_HYBRID = Config(world_size=4, model=_MODEL, wrap=("blocks.0",), strategy="HYBRID_SHARD")
_FLAT = Config(world_size=2, model=_MODEL, wrap=("blocks.0",))
_MIXED = Config(world_size=2, model=_MODEL, wrap=("blocks.0",), policy=Policy(reduce_dtype="float32", cast_inputs=True))
#: A first block of buffers only: its units gather nothing, so no order is checked (nothing to refuse).
_BUFFERS_ONLY = Config(world_size=2, model=ModelSpec(blocks=(Block(("scale",)),)))
_ORDERED = Config(world_size=2, model=_MODEL, strategy="SHARD_GRAD_OP", use_orig_params=True)
_SHARDED = Config(world_size=2, model=_MODEL, wrap=("blocks.0",), api="fully_shard")
#: Four units whose all-gathers differ in size, so their order can be told ([Note: prefetch lists in order]).
_PREFETCHED = Config(world_size=2, model=ModelSpec(width=4, vocab=7, blocks=(Block(("linear",)), Block(("conv3",)),
                                                                             Block(("norm",)))),
                     wrap=("blocks.0", "blocks.1", "blocks.2"), api="fully_shard")
_UNPREFETCHED = Config(world_size=2, model=_PREFETCHED.model, wrap=_PREFETCHED.wrap)


def _neighbours(ctx: RankContext, impl: FSDPAdapter, config: Config) -> str | None:
    return check_neighbours(ctx, impl, config)


@pytest.mark.parametrize(("impl", "config"), [
    (ReferenceAdapter(), _HYBRID), (TorchFSDP1Adapter(), _HYBRID), (ReferenceAdapter(), _FLAT),
    (TorchFSDP1Adapter(), _FLAT), (ReferenceAdapter(), _SHARDED), (TorchFSDP2Adapter(), _SHARDED),
    (ReferenceAdapter(), _ORDERED), (TorchFSDP1Adapter(), _ORDERED), (ReferenceAdapter(), _MIXED),
    (TorchFSDP1Adapter(), _MIXED), (ReferenceAdapter(), _BUFFERS_ONLY), (ReferenceAdapter(), _PREFETCHED),
    (TorchFSDP2Adapter(), _PREFETCHED), (ReferenceAdapter(), _UNPREFETCHED), (TorchFSDP1Adapter(), _UNPREFETCHED),
], ids=["reference-hybrid", "torch-fsdp1-hybrid", "reference-flat", "torch-fsdp1-flat", "reference-fully-shard",
        "torch-fsdp2-fully-shard", "reference-order", "torch-fsdp1-order", "reference-mixed", "torch-fsdp1-mixed",
        "reference-buffers-only", "reference-prefetch-lists", "torch-fsdp2-prefetch-lists",
        "reference-no-forward-prefetch", "torch-fsdp1-no-forward-prefetch"])
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_reference_and_torch_refuse(impl: FSDPAdapter, config: Config, mode: str) -> None:
    got = run(_neighbours, world_size=config.world_size, mode=mode, timeout_s=120, args=(impl, config))
    assert got == [None] * config.world_size, got


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
], ids=["lenient-hybrid-groups", "no-optim-in-backward-check", "shard-args-unchecked", "no-exec-order-check",
        "checks-eval-forwards", "auto-wrap-children-only", "eval-in-low-precision", "silent", "warns-every-iteration",
        "prefetch-list-reversed", "always-prefetch", "unsafe-setattr-ignored"])
def test_mutants_fail_before_wrapping(mutant: FSDPAdapter, config: Config, message: str) -> None:
    """The whole program fails before its wrap, on every rank, naming what was accepted (fresh rank processes:
    a mutant's patches stay where it ran)."""
    from conformance.cases.fuzz.stateful import check_program

    got = run(check_program, world_size=config.world_size, mode="process", timeout_s=240, isolated=True,
              args=(mutant, Program(config, (Train(),))))
    assert all(text == got[0] for text in got), got
    assert got[0] is not None and got[0].startswith("before wrapping, rank "), got[0]
    assert re.search(message, got[0]), got[0]


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
    from conformance.cases.fuzz.model import build_model
    from conformance.cases.fuzz.prefetching import _spans

    def spans(config: Config) -> object:
        return _spans(build_model(config.model, 0, torch.float32, torch.device("cpu")), config)

    assert spans(_PREFETCHED) is not None
    same = Config(world_size=2, model=ModelSpec(width=4, vocab=7, blocks=(Block(), Block(), Block(("norm",)))),
                  wrap=("blocks.0", "blocks.1", "blocks.2"), api="fully_shard")
    assert spans(same) is None
    assert spans(Config(world_size=2, model=_PREFETCHED.model, wrap=("blocks.1",), api="fully_shard")) is None
