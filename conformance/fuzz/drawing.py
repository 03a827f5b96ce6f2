"""Drawing stateful programs ([Note: stateful programs] in :mod:`conformance.fuzz.ops`) with hypothesis."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace
from typing import get_args

from hypothesis import strategies as st

from conformance.fuzz.drawn_optimizers import stateful_optimizer
from conformance.fuzz.example import DTYPES, FUZZ_STRATEGIES, OPTIMIZERS, ModelSpec, Policy, models, policies
from conformance.fuzz.ops import (
    APIS,
    BATCHES,
    CONTROL_OPS,
    FEATURES,
    HYBRID_OF,
    WRAP_OPS,
    Backward,
    ClipGradNorm,
    Forward,
    FullyShardConfig,
    GradientDivideFactor,
    GradSync,
    Load,
    Mode,
    NoSync,
    Op,
    Prefetch,
    Program,
    ProgramConfig,
    Reshard,
    ReshardAfterBackward,
    Save,
    ScaleParams,
    SetReshardAfterForward,
    Step,
    SummonFull,
    Train,
    Unshard,
    WrapConfig,
    ZeroGrad,
    hybrid_fits,
)

__all__ = ["OPERATIONS", "SET_ASIDE", "programs"]

#: The names of the operations a program may hold (``Train``, ``Load``, ...).
OPERATIONS = frozenset(kind.__name__ for kind in get_args(Op))
#: What a search may set aside ([Note: known findings in a search] in :mod:`conformance.fuzz.searching`):
#: configuration features and operations.
SET_ASIDE = FEATURES | OPERATIONS


#: A training iteration first: hypothesis draws and shrinks towards the first choice, so the simplest
#: program trains (a forward alone would check little) and a shrunk one reads as iterations plus what matters.
#: Then what needs company to show a breakage (an accumulation in ``no_sync``; a save, a change, a load).
#: The order moves every draw of a seed; it is chosen by what a small budget reaches (``python -m
#: conformance.selftest.fuzz_alone``): listed last, these three reach none of their mutants in 20 programs per row
#: at seed 0.
_OPS = (
    st.builds(Train, batch=st.integers(0, BATCHES - 1)),
    st.builds(NoSync, batch=st.integers(0, BATCHES - 1)),
    st.builds(Save, sharded=st.booleans(), optim=st.booleans().map(lambda b: not b)),
    st.just(Load()),
    st.builds(Forward, batch=st.integers(0, BATCHES - 1), grad=st.booleans().map(lambda b: not b),
              loss=st.sampled_from(("all", "main"))),
    st.just(Backward()),
    st.just(Step()),
    st.builds(ZeroGrad, set_to_none=st.booleans().map(lambda b: not b)),
    st.builds(Mode, train=st.booleans()),
    # gradient norms of the drawn models run from about 0.03 to 1: the first clips nearly always, the last seldom
    st.builds(ClipGradNorm, max_norm=st.sampled_from((0.05, 0.2, 1.0)), norm_type=st.sampled_from((2.0, math.inf))),
    # powers of two: the products are exact in every dtype, on both sides
    st.builds(ScaleParams, scale=st.sampled_from((0.5, -2.0))),
)


def _controls(config: ProgramConfig) -> st.SearchStrategy[Op]:
    """The controls of a ``fully_shard``-ed model on ``config``, drawn together as often as one other
    operation (such a program still trains, saves and loads as much as another)."""
    units = st.sampled_from(config.units())
    return st.one_of(
        st.builds(Unshard, unit=units, async_op=st.booleans(), batch=st.integers(0, BATCHES - 1)),
        st.builds(Reshard, unit=units), st.builds(GradSync, on=st.booleans()),
        st.builds(ReshardAfterBackward, on=st.booleans()),
        st.builds(Prefetch, forward=st.integers(0, 2), backward=st.integers(0, 2)),
        st.builds(SetReshardAfterForward, unit=units, on=st.booleans(), recurse=st.booleans().map(lambda b: not b)),
        # a factor other than the world size shows (at one rank, 1.0 is the default: 2.0 shows there)
        st.builds(GradientDivideFactor, factor=st.sampled_from((2.0 * config.world_size, 1.0)), unit=units),
    )


def _summons(config: ProgramConfig) -> st.SearchStrategy[Op]:
    """A wrapped model's :class:`SummonFull` of one of ``config``'s units, each option drawn."""
    return st.builds(SummonFull, unit=st.sampled_from(config.units()), recurse=st.booleans().map(lambda b: not b),
                     rank0_only=st.booleans(), offload_to_cpu=st.booleans(), with_grads=st.booleans())


#: A control -> the feature it needs, where that is not ``fully_shard_controls``.
_NEEDS = {Prefetch: "explicit_prefetch", SetReshardAfterForward: "set_reshard_after_forward",
          GradientDivideFactor: "gradient_divide_factor"}


def _subset(draw: st.DrawFn, paths: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p for p in paths if draw(st.booleans()))


@st.composite
def _configs(draw: st.DrawFn, world_size: int, strategies: Collection[str],
             features: Collection[str]) -> tuple[ProgramConfig, bool]:
    """A configuration, and whether it drew the ``fully_shard`` API (whatever ``features`` then made of it)."""
    model = draw(models())
    wrap = _subset(draw, model.wrappable())
    strategy, use_orig_params = _strategy(draw, world_size, strategies, features), draw(st.booleans())
    optimizer, dtype = draw(st.sampled_from(OPTIMIZERS)), _dtype(draw(st.sampled_from(DTYPES)), features)
    drawn_policy, cast_inputs = draw(policies(model, world_size, _policy_features(features))), draw(st.booleans())
    policy = drawn_policy if "mixed_precision" in features else None  # fully_shard's alone: no wrap policy
    if policy is not None and cast_inputs and "cast_forward_inputs" in features:
        policy = replace(policy, cast_inputs=True)
    offload = draw(st.booleans())
    checkpoint = _subset(draw, tuple(f"blocks.{i}" for i in range(len(model.blocks))))
    frozen = _subset(draw, model.wrappable() if use_orig_params else wrap)
    seed = draw(st.integers(min_value=0, max_value=2**16))
    trained_with = stateful_optimizer(optimizer, seed)  # [Note: drawn optimizers]
    config = WrapConfig(world_size=world_size, model=model, wrap=wrap, strategy=strategy,
                        use_orig_params=use_orig_params, optimizer=trained_with, dtype=dtype,
                        policy=policy if dtype == "float32" else None,
                        cpu_offload=offload and "cpu_offload" in features, checkpoint=checkpoint, frozen=frozen,
                        seed=seed)
    config = replace(config, model=_units_first_when_recomputed(config))
    api, raf = draw(st.sampled_from(APIS)), draw(st.sampled_from((True, False, 2)))
    if api != "fully_shard" or "fully_shard" not in features:
        # without a policy the cast_inputs draw is free (see [Note: options from an unused draw])
        ignore = cast_inputs and config.policy is None and "ignored_modules" in features
        return replace(config, model=_reentrant_blocks(config), ignored=config.ignorable() if ignore else (),
                       policy=_unused_draw_options(config.policy, raf, optimizer, features),
                       saves_in_iteration=raf == 2), api == "fully_shard"
    # fully_shard has no strategy or offload to express, and keeps the original parameters
    sharded = FullyShardConfig(world_size=world_size, model=config.model, wrap=wrap, optimizer=trained_with,
                               dtype=dtype,
                               policy=_fully_shard_policy(drawn_policy if dtype == "float32" else None, features),
                               checkpoint=checkpoint, frozen=frozen, seed=seed,
                               reshard_after_forward=_reshard_after_forward(raf, world_size, features),
                               meta_init=use_orig_params and "meta_init" in features)
    ignore = cast_inputs and sharded.policy is None and "ignored_modules" in features
    return replace(sharded, ignored=sharded.ignorable() if ignore else ()), True


def _dtype(drawn: str, features: Collection[str]) -> str:
    """The model dtype of a program that drew ``drawn``: float64 only where ``features`` has it, else float32
    (the draw is made either way, so the programs are otherwise those of an adapter that has it)."""
    return drawn if drawn != "float64" or "float64" in features else "float32"


def _policy_features(features: Collection[str]) -> frozenset[str]:
    """The precision features a policy is drawn with: a ``fully_shard`` policy needs no ``wrap`` mixed
    precision (an FSDP2-only adapter may declare ``FULLY_SHARD_MIXED_PRECISION`` alone), so
    with it a policy is drawn and kept for ``fully_shard`` programs only (every choice is drawn either way)."""
    ours = frozenset(features)
    return ours | {"mixed_precision"} if "fully_shard_mixed_precision" in ours else ours


def _fully_shard_policy(policy: Policy | None, features: Collection[str]) -> Policy | None:
    """A ``fully_shard`` program's policy: the one drawn, in FSDP2's terms (no ``buffer_dtype``; forward inputs
    cast, ``MixedPrecisionPolicy``'s default, which the capability covers), where the adapter takes one."""
    if policy is None or "fully_shard_mixed_precision" not in features:
        return None
    return replace(policy, buffer_dtype=None, cast_inputs=True)


def _unused_draw_options(policy: Policy | None, raf: bool | int, optimizer: str,
                         features: Collection[str]) -> Policy | None:
    """A ``wrap`` program's ``policy`` with the options read off its ``reshard_after_forward`` draw.

    [Note: options from an unused draw]
    Hypothesis draws a byte stream: a choice drawn anywhere, even after everything
    else, moves every later example of a seed, and the mutants' declared rows, the
    registered findings and the tests' seeds rely on what each seed draws. A
    ``wrap`` program draws ``reshard_after_forward`` (``True``, ``False``, ``2``)
    and uses it only under ``fully_shard``, so policy options added later are read
    off that draw instead of drawing: ``False`` keeps low-precision gradients (the
    first choice, ``True``, where it shrinks to, leaves it off), and ``2`` takes
    state dicts inside each training iteration (``WrapConfig.saves_in_iteration``,
    set by the caller: it is no policy option, and holds without a policy).
    ``keep_low_precision_grads`` only with SGD:
    torch's Adam rejects float32 parameters with low-precision gradients, and
    torch documents the option for "a custom optimizer that supports running in
    low precision". Likewise ``cast_inputs`` is drawn for every program and read only under a ``wrap``
    program's policy; without a policy, ``True`` ignores what :meth:`Config.ignorable` allows (a
    ``fully_shard`` program's policy casts its inputs, FSDP2's default). A ``fully_shard`` program keeps
    the original parameters whatever ``use_orig_params`` drew: there ``True`` builds the model on the meta
    device (``FullyShardConfig.meta_init``).
    """
    if policy is None:
        return None
    keep_low = raf is False and optimizer == "sgd" and "keep_low_precision_grads" in features
    return replace(policy, keep_low_precision_grads=keep_low) if keep_low else policy


def _reentrant_blocks(config: WrapConfig) -> ModelSpec:
    """The model of a ``wrap`` program, its blocks outside the checkpoint wrapper checkpointing themselves
    reentrantly where its seed is odd.

    [Note: reentrant blocks]
    A reentrant checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``)
    recomputes its part of the forward in a backward of its own, nested in the
    user's: the parameters it used get their gradient there, the rest of their
    unit's in the outer backward, so a unit receives its gradient in pieces, and
    must keep its parameters gathered for the outer backward after the nested
    one is done. The model's own code checkpoints (no FSDP API does). Only
    ``wrap`` programs have it: for ``fully_shard`` the contract states nothing
    about reentrant checkpointing (torch's FSDP2 documents none; its programs
    draw the non-reentrant checkpoint wrapper). Which blocks
    is read off the parity of the program's model seed, so that no draw moves
    ([Note: options from an unused draw]): an odd seed makes every block outside
    the checkpoint wrapper reentrant. A block recomputes only where its input
    needs a gradient (a reentrant checkpoint gives its parameters none otherwise),
    which the shadow's blocks decide alike ([Note: the shadow model] in
    :mod:`conformance.fuzz.shadow`).
    """
    if config.seed % 2 == 0:
        return config.model
    blocks = tuple(replace(block, reentrant=f"blocks.{i}" not in config.checkpoint)
                   for i, block in enumerate(config.model.blocks))
    return replace(config.model, blocks=blocks)


def _units_first_when_recomputed(config: ProgramConfig) -> ModelSpec:
    """The config's model, each checkpointed block whose nested block is a unit running that unit first.

    [Note: units recomputed first]
    A block in the checkpoint wrapper is computed again in backward, and a unit
    inside it with it: the unit's forward runs inside backward and must gather
    its parameters again, for a strategy that freed them after forward. Where the
    unit ends the block, the backward of its outputs (the pre-backward of the unit)
    comes first and gathers them anyway; where it begins the block, the block is
    recomputed (at its first saved activation needed) before that. So a
    checkpointed block whose nested block is one of the program's units runs the
    nested block first (``Block.inner_first``), the model's own code, which the
    shadow runs alike. The wrap plan decides, so no draw moves ([Note: options
    from an unused draw]). ``checkpoint/checkpoint_fsdp_wrapping`` checks the same
    on its own model.
    """
    first = {f"blocks.{i}" for i in range(len(config.model.blocks))
             if f"blocks.{i}" in config.checkpoint and f"blocks.{i}.inner" in config.wrap}
    blocks = tuple(replace(block, inner_first=f"blocks.{i}" in first) for i, block in enumerate(config.model.blocks))
    return replace(config.model, blocks=blocks)


def _strategy(draw: st.DrawFn, world_size: int, strategies: Collection[str], features: Collection[str]) -> str:
    """A strategy; where a hybrid layout fits ([Note: hybrid programs]) the hybrid ones are drawn too, first
    (the simplest choice there: only such world sizes can test them, the others test the rest), and stand
    for their non-hybrid counterpart where the adapter has none (so one seed draws alike for all)."""
    hybrids = tuple(HYBRID_OF[s] for s in strategies if s in HYBRID_OF) if hybrid_fits(world_size) else ()
    strategy = draw(st.sampled_from((*hybrids, *strategies)))
    if strategy in hybrids and "hybrid" not in features:
        return next(plain for plain, hybrid in HYBRID_OF.items() if hybrid == strategy)
    return strategy


def _reshard_after_forward(drawn: bool | int, world_size: int, features: Collection[str]) -> bool | int:
    """``drawn``, an int only where the adapter has it and it is a proper factor of ``world_size`` (else ``True``)."""
    if isinstance(drawn, bool):
        return drawn
    fits = "reshard_after_forward_int" in features and 1 < drawn < world_size and world_size % drawn == 0
    return drawn if fits else True


@st.composite
def programs(
    draw: st.DrawFn, world_size: int, strategies: Collection[str] = FUZZ_STRATEGIES,
    features: Collection[str] = FEATURES, max_ops: int = 12, set_aside: Collection[str] = (),
) -> Program:
    """Programs for ``world_size`` ranks over the given ``strategies`` and configuration ``features``
    (of :data:`FEATURES`), with up to ``max_ops`` operations, none of what ``set_aside`` names (of
    :data:`SET_ASIDE`; read at each draw, so a search may add to it as it goes: the draws keep their shape,
    what is set aside is dropped after drawing, as a feature the adapter lacks is)."""
    allowed = [s for s in FUZZ_STRATEGIES if s in strategies]  # hybrid ones: the "hybrid" feature
    if not allowed:
        raise ValueError(f"no fuzz strategy among {sorted(strategies)}; the fuzzer draws from {FUZZ_STRATEGIES}")
    for names, vocabulary, what in ((features, FEATURES, "features"), (set_aside, SET_ASIDE, "names to set aside")):
        unknown = sorted(set(names) - vocabulary)
        if unknown:
            raise ValueError(f"unknown {what} {unknown}; expected some of {sorted(vocabulary)}")
    kept = frozenset(features) - frozenset(set_aside)
    config, drew_fully_shard = draw(_configs(world_size, allowed, kept))
    with_controls = drew_fully_shard and "fully_shard" in features  # set aside or not: the same draws
    # a wrapped model's own operations: for a program that drew wrap, whatever the adapter then offers
    drawn = st.one_of(*_OPS, _controls(config)) if with_controls else st.one_of(*_OPS, _summons(config))
    ops = draw(st.lists(drawn, min_size=1, max_size=max_ops))
    return Program(config, tuple(op for op in ops if _runs(op, config, kept) and type(op).__name__ not in set_aside))


def _runs(op: Op, config: ProgramConfig, features: Collection[str]) -> bool:
    """Whether ``op`` stays in a program on ``config``: a control only where the adapter has it (a
    ``fully_shard`` program draws every control, so a seed draws the same program for every adapter
    with ``fully_shard``)."""
    if isinstance(op, WRAP_OPS):
        return isinstance(config, WrapConfig)
    if not isinstance(op, CONTROL_OPS):
        return True
    return isinstance(config, FullyShardConfig) and _NEEDS.get(type(op), "fully_shard_controls") in features
