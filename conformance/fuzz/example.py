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

from collections.abc import Collection
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

from hypothesis import strategies as st

__all__ = ["LAYERS", "OPTIMIZERS", "DTYPES", "FUZZ_STRATEGIES", "Block", "ModelSpec", "Example", "examples", "source"]

#: Layer kinds a block may hold: a width x width linear, a 1-D convolution of
#: kernel 1 or 3 over the sequence axis, a LayerNorm.
LAYERS = ("linear", "conv1", "conv3", "norm")
OPTIMIZERS = ("sgd", "adam")
DTYPES = ("float32", "float64")
#: Strategies the fuzzer draws (hybrid strategies need group pairs: not drawn).
FUZZ_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@dataclass(frozen=True)
class Block:
    """A sequence of layers with ``tanh`` after each linear/conv; optionally a nested block.

    ``tie``: the block's second linear shares the first linear's weight (both
    are width x width); a tie never crosses a unit boundary, because only
    whole blocks are wrapped. ``inner``: layers of a nested block applied after
    ``layers`` (empty: no nested block).
    """

    layers: tuple[str, ...] = ("linear",)
    tie: bool = False
    inner: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [kind for kind in (*self.layers, *self.inner) if kind not in LAYERS]
        if bad or not self.layers:
            raise ValueError(f"Block layers must be a non-empty tuple from {LAYERS}, got {self.layers} / {self.inner}")
        if self.tie and self.layers.count("linear") < 2:
            raise ValueError(f"Block(tie=True) needs two linears, got layers={self.layers}")


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


@dataclass(frozen=True)
class Example:
    """One fuzz example: model, wrap plan, strategy, optimizer, dtype and accumulation.

    ``wrap``: module paths wrapped as their own units (inner first, then the
    root). ``micro_batches``: backwards per optimizer step (gradients
    accumulate); ``set_to_none``: how gradients are zeroed after each step.
    """

    world_size: int
    model: ModelSpec = ModelSpec()
    wrap: tuple[str, ...] = ()
    strategy: str = "FULL_SHARD"
    use_orig_params: bool = False
    optimizer: str = "sgd"
    dtype: str = "float32"
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


@st.composite
def _blocks(draw: st.DrawFn) -> Block:
    layers = tuple(draw(st.lists(st.sampled_from(LAYERS), min_size=1, max_size=3)))
    tie = layers.count("linear") >= 2 and draw(st.booleans())
    inner = tuple(draw(st.lists(st.sampled_from(LAYERS), min_size=0, max_size=2)))
    return Block(layers=layers, tie=tie, inner=inner)


@st.composite
def _models(draw: st.DrawFn) -> ModelSpec:
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
def examples(draw: st.DrawFn, world_size: int, strategies: Collection[str] = FUZZ_STRATEGIES) -> Example:
    """Examples for ``world_size`` ranks, drawing only the given ``strategies``."""
    allowed = [s for s in FUZZ_STRATEGIES if s in strategies]
    if not allowed:
        raise ValueError(f"no fuzz strategy among {sorted(strategies)}; the fuzzer draws from {FUZZ_STRATEGIES}")
    model = draw(_models())
    wrappable = model.wrappable()
    wrap = tuple(p for p in wrappable if draw(st.booleans()))
    return Example(
        world_size=world_size,
        model=model,
        wrap=wrap,
        strategy=draw(st.sampled_from(allowed)),
        use_orig_params=draw(st.booleans()),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        dtype=draw(st.sampled_from(DTYPES)),
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
    return repr(value)
