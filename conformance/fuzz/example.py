"""What one fuzz example is, as plain data, and the hypothesis strategy that draws it.

[Note: fuzz examples are plain data]
An :class:`Example` holds only ints, strings, booleans and tuples of them, so
it pickles, compares with ``==``, and its ``repr`` is Python that rebuilds it
(``eval(repr(ex), vars(conformance.fuzz.example)) == ex``). The fuzzer draws
examples on rank 0 only and broadcasts them; every rank then builds the same
model from the same description. A failing example is printed as a ready-to-paste
case whose body is ``run_example(ctx, impl, <repr>)``.

Choices are listed simplest first: hypothesis shrinks a ``sampled_from`` towards
its first element, integers towards their minimum and booleans towards
``False``, so a shrunk reproducer reads as "the default, except ...".
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

from hypothesis import strategies as st

from conformance.contract.world_size import Exact

__all__ = [
    "LAYERS", "OPTIMIZERS", "DTYPES", "LOW_DTYPES", "FUZZ_STRATEGIES", "PRECISION_FEATURES",
    "exact_low_precision_reduction", "ONE_RANK", "ONE_RANK_BF16",
    "Block", "ModelSpec", "Policy", "Example", "examples", "models", "policies", "source",
]

#: Layer kinds a block may hold: a width x width linear, a 1-D convolution of
#: kernel 1 or 3 over the sequence axis, a LayerNorm, a per-feature scale by a
#: floating buffer (the fuzz models' only buffers, so ``buffer_dtype`` matters).
LAYERS = ("linear", "conv1", "conv3", "norm", "scale")
OPTIMIZERS = ("sgd", "adam")
DTYPES = ("float32", "float64")
#: Mixed-precision compute dtypes. float16 is drawn on every device, as the
#: mixed_precision area runs it everywhere: every layer kind computes forward and
#: backward in both on the CPU (``conformance/tests/fuzz/test_fuzz.py`` checks that).
LOW_DTYPES = ("bfloat16", "float16")
#: What of a mixed-precision policy :func:`examples` may draw: ``"mixed_precision"``
#: (param and reduce dtypes), ``"buffer_dtype"`` (needs ``"mixed_precision"`` too).
PRECISION_FEATURES = frozenset({"mixed_precision", "buffer_dtype"})
#: Strategies the fuzzer draws (hybrid strategies need group pairs: not drawn).
FUZZ_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@dataclass(frozen=True)
class Block:
    """A sequence of layers with ``tanh`` after each linear/conv; optionally a nested block.

    ``tie``: the block's second linear shares the first linear's weight (both
    are width x width); a tie never crosses a unit boundary, because only
    whole blocks are wrapped. ``inner``: layers of a nested block applied after
    ``layers`` (empty: no nested block). ``reentrant``: the block's own forward
    runs ``layers`` under ``torch.utils.checkpoint`` with ``use_reentrant=True``
    when it computes gradients, as a user's model code checkpoints itself (only
    the stateful fuzzer sets it: [Note: reentrant blocks] in
    :mod:`conformance.fuzz.drawing`). ``inner_first``: the nested block
    runs before ``layers`` (only the stateful fuzzer sets it: [Note: units
    recomputed first] there).
    """

    layers: tuple[str, ...] = ("linear",)
    tie: bool = False
    inner: tuple[str, ...] = ()
    reentrant: bool = False
    inner_first: bool = False

    def __post_init__(self) -> None:
        bad = [kind for kind in (*self.layers, *self.inner) if kind not in LAYERS]
        if bad or not self.layers:
            raise ValueError(f"Block layers must be a non-empty tuple from {LAYERS}, got {self.layers} / {self.inner}")
        if self.tie and self.layers.count("linear") < 2:
            raise ValueError(f"Block(tie=True) needs two linears, got layers={self.layers}")
        if self.inner_first and not self.inner:
            raise ValueError("Block(inner_first=True) needs a nested block, got inner=()")


@dataclass(frozen=True)
class ModelSpec:
    """A small model: optional embedding input, blocks, a head, extra branches.

    ``vocab=0`` means dense ``(batch, seq, width)`` inputs; otherwise token ids
    through an ``Embedding(vocab, width)``, and ``tie_head`` makes the head's
    weight the embedding's. ``aux_output``: the first block's output is a second
    model output, used in the loss. ``unused``: an extra block runs in forward
    but its output never reaches the loss (its parameters get no gradient).
    """

    width: int = 2
    vocab: int = 0
    blocks: tuple[Block, ...] = (Block(),)
    tie_head: bool = False
    aux_output: bool = False
    unused: bool = False

    def __post_init__(self) -> None:
        if self.width < 1 or self.vocab < 0 or not self.blocks:
            raise ValueError(f"ModelSpec needs width >= 1, vocab >= 0 and a block, got {self}")
        if self.tie_head and not self.vocab:
            raise ValueError("ModelSpec(tie_head=True) needs an embedding (vocab > 0)")

    def wrappable(self) -> tuple[str, ...]:
        """Module paths a wrap plan may choose from (whole blocks, nested blocks, the unused block)."""
        paths = []
        for index, block in enumerate(self.blocks):
            paths.append(f"blocks.{index}")
            if block.inner:
                paths.append(f"blocks.{index}.inner")
        if self.unused:
            paths.append("unused")
        return tuple(paths)

    def has_buffers(self) -> bool:
        """Whether the model has a floating buffer (a ``scale`` layer), so ``buffer_dtype`` applies."""
        return any("scale" in (*block.layers, *block.inner) for block in self.blocks)


@dataclass(frozen=True)
class Policy:
    """A mixed-precision policy by dtype names (plain data, see [Note: fuzz examples are plain data]).

    ``param_dtype``: what all-gathers carry and forward and backward compute in;
    ``reduce_dtype``: gradient reduction (``None``: the param dtype);
    ``buffer_dtype``: buffers during compute (``None``: their own). Parameters,
    gradients and optimizer state stay in float32. ``cast_inputs``: the root casts
    floating inputs to the param dtype (else they come in it already; see
    [Note: fuzz mixed-precision baseline]; only the stateful fuzzer draws it).
    ``keep_low_precision_grads``: gradients reach the optimizer in the dtype they were
    reduced in, not upcast to float32; only the stateful fuzzer draws it
    ([Note: options from an unused draw] in :mod:`conformance.fuzz.drawing`).
    """

    param_dtype: str = "bfloat16"
    reduce_dtype: str | None = None
    buffer_dtype: str | None = None
    cast_inputs: bool = False
    keep_low_precision_grads: bool = False

    def __post_init__(self) -> None:
        checks = {
            "param_dtype": (self.param_dtype, LOW_DTYPES),
            "reduce_dtype": (self.reduce_dtype, (None, "float32")),
            "buffer_dtype": (self.buffer_dtype, (None, *LOW_DTYPES)),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"Policy.{name}={value!r}; expected one of {allowed}")


def exact_low_precision_reduction(policy: Policy, world_size: int) -> bool:
    """Whether gradients reduced in ``policy.param_dtype`` over ``world_size`` ranks have one correct value.

    [Note: low-precision reductions in the fuzzer]
    The local baseline sums the ranks' gradients, then divides by the world size.
    An implementation may add in another order (ring, tree) and divide before
    adding as well as after (torch's FSDPs predivide to avoid float16 overflow).
    Those give the same value, bit for bit, when every step is exact or rounded
    once: one rank (nothing to reduce), or two bfloat16 ranks (a sum of two
    values is rounded once in any order, and halving is exact in bfloat16's
    float32 exponent range). With four ranks the partial sums are rounded in an
    order the implementation chooses, and float16's halving rounds below 6.1e-5
    (its subnormals): there even the reference and torch differ from the
    baseline, and from each other, by a rounding that an optimizer such as Adam
    carries into the parameters. There the fuzzer reduces in float32.
    """
    return world_size == 1 or (world_size == 2 and policy.param_dtype == "bfloat16")


#: Reproducers of one rank's behaviour ([Note: world sizes] in :mod:`conformance.contract.world_size`).
ONE_RANK = Exact(1, reason="one rank, where torch-fsdp1 runs NO_SHARD")
ONE_RANK_BF16 = Exact(1, reason="its bfloat16 reduction has one correct value at 1 rank (and 2), not more")


@dataclass(frozen=True)
class Example:
    """One fuzz example: model, wrap plan, strategy, optimizer, dtype policy and accumulation.

    ``wrap``: module paths wrapped as their own units (inner first, then the
    root). ``policy``: mixed precision for every unit (``None``: everything in
    ``dtype``; a policy needs float32 parameters). ``micro_batches``: backwards
    per optimizer step (gradients accumulate); ``set_to_none``: how gradients
    are zeroed after each step.
    """

    world_size: int
    model: ModelSpec = ModelSpec()
    wrap: tuple[str, ...] = ()
    strategy: str = "FULL_SHARD"
    use_orig_params: bool = False
    optimizer: str = "sgd"
    dtype: str = "float32"
    policy: Policy | None = None
    micro_batches: int = 1
    set_to_none: bool = True
    steps: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.wrap) - set(self.model.wrappable()))
        if unknown:
            raise ValueError(f"wrap names {unknown}, not among {self.model.wrappable()}")
        checks = {
            "strategy": (self.strategy, FUZZ_STRATEGIES),
            "optimizer": (self.optimizer, OPTIMIZERS),
            "dtype": (self.dtype, DTYPES),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"Example.{name}={value!r}; expected one of {allowed}")
        if self.world_size < 1 or self.micro_batches < 1 or self.steps < 1:
            raise ValueError(f"world_size, micro_batches and steps must be >= 1, got {self}")
        if self.policy is not None and self.dtype != "float32":
            raise ValueError(f"Example(policy={self.policy}) keeps parameters in float32, got dtype={self.dtype!r}")
        policy = self.policy
        if policy and policy.reduce_dtype is None and not exact_low_precision_reduction(policy, self.world_size):
            raise ValueError(f"Example(world_size={self.world_size}, policy={policy}): a {policy.param_dtype} "
                             "reduction there has no baseline (see exact_low_precision_reduction); "
                             "give reduce_dtype='float32'")
        if self.policy is not None and self.policy.buffer_dtype is not None and not self.model.has_buffers():
            raise ValueError(f"Policy(buffer_dtype={self.policy.buffer_dtype!r}) needs a model with a 'scale' layer")


@st.composite
def _blocks(draw: st.DrawFn) -> Block:
    layers = tuple(draw(st.lists(st.sampled_from(LAYERS), min_size=1, max_size=3)))
    tie = layers.count("linear") >= 2 and draw(st.booleans())
    inner = tuple(draw(st.lists(st.sampled_from(LAYERS), min_size=0, max_size=2)))
    return Block(layers=layers, tie=tie, inner=inner)


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    vocab = draw(st.sampled_from((0, 7, 11)))
    return ModelSpec(
        width=draw(st.integers(min_value=2, max_value=6)),
        vocab=vocab,
        blocks=tuple(draw(st.lists(_blocks(), min_size=1, max_size=3))),
        tie_head=bool(vocab) and draw(st.booleans()),
        aux_output=draw(st.booleans()),
        unused=draw(st.booleans()),
    )


@st.composite
def policies(draw: st.DrawFn, model: ModelSpec, world_size: int, precision: Collection[str]) -> Policy | None:
    """``None`` or a policy. Every choice is drawn whatever ``precision`` allows, then what it
    does not allow is dropped, so a seed draws the same models for every implementation."""
    param = draw(st.sampled_from((None, *LOW_DTYPES)))
    if param is None:
        return None
    exact = exact_low_precision_reduction(Policy(param), world_size)  # see its note
    reduce = draw(st.sampled_from((None, "float32"))) if exact else "float32"
    buffer = draw(st.sampled_from((None, *LOW_DTYPES))) if model.has_buffers() else None
    if "mixed_precision" not in precision:
        return None
    return Policy(param, reduce, buffer if "buffer_dtype" in precision else None)


@st.composite
def examples(
    draw: st.DrawFn,
    world_size: int,
    strategies: Collection[str] = FUZZ_STRATEGIES,
    precision: Collection[str] = PRECISION_FEATURES,
    dtypes: Collection[str] = DTYPES,
) -> Example:
    """Examples for ``world_size`` ranks, drawing only the given ``strategies``; mixed-precision
    policies use only the ``precision`` features (of :data:`PRECISION_FEATURES`) given; models only
    the given ``dtypes`` (of :data:`DTYPES`)."""
    allowed = [s for s in FUZZ_STRATEGIES if s in strategies]
    if not allowed:
        raise ValueError(f"no fuzz strategy among {sorted(strategies)}; the fuzzer draws from {FUZZ_STRATEGIES}")
    unknown = sorted(set(precision) - PRECISION_FEATURES)
    if unknown:
        raise ValueError(f"unknown precision features {unknown}; expected some of {sorted(PRECISION_FEATURES)}")
    model = draw(models())
    wrappable = model.wrappable()
    wrap = tuple(p for p in wrappable if draw(st.booleans()))
    strategy, use_orig_params = draw(st.sampled_from(allowed)), draw(st.booleans())
    optimizer, dtype = draw(st.sampled_from(OPTIMIZERS)), draw(st.sampled_from(DTYPES))
    dtype = dtype if dtype in dtypes else "float32"  # drawn either way: the examples are otherwise the same
    return Example(
        world_size=world_size,
        model=model,
        wrap=wrap,
        strategy=strategy,
        use_orig_params=use_orig_params,
        optimizer=optimizer,
        dtype=dtype,
        policy=draw(policies(model, world_size, precision)) if dtype == "float32" else None,
        micro_batches=draw(st.integers(min_value=1, max_value=3)),
        set_to_none=not draw(st.booleans()),
        steps=draw(st.integers(min_value=2, max_value=3)),
        seed=draw(st.integers(min_value=0, max_value=2**16)),
    )


def source(value: Any) -> str:
    """Python that rebuilds ``value``, naming only the fields that differ from their defaults.

    A shrunk example is mostly defaults, so its source reads as the few choices
    that matter (``Example(world_size=2, strategy='NO_SHARD')``).
    """
    if is_dataclass(value) and not isinstance(value, type):
        parts = []
        for f in fields(value):
            item = getattr(value, f.name)
            if f.default is MISSING or item != f.default:
                parts.append(f"{f.name}={source(item)}")
        return f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, tuple):
        inner = ", ".join(source(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, float) and math.isinf(value):
        return f"float({str(value)!r})"  # repr(inf) is no Python
    return repr(value)
