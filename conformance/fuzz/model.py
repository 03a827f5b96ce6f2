"""Build the module and the inputs a :class:`~conformance.fuzz.example.ModelSpec` describes.

Everything is a function of the spec and an integer seed (private generators,
see [Note: fixture determinism] in ``fixtures.seeding``), so every rank and the
local baseline build identical modules and inputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from conformance.fuzz.example import Block, ModelSpec
from fixtures.seeding import generator, seeded_init_

__all__ = ["FuzzBlock", "FuzzModel", "build_model", "dense_batch", "holds_parameters", "make_batch", "loss_of"]

#: Batch and sequence sizes of every input (small: the fuzzer runs many examples).
BATCH, SEQ = 2, 3


class _Conv(nn.Module):
    """A same-length 1-D convolution over the sequence axis of ``(batch, seq, width)``."""

    def __init__(self, width: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class _Scale(nn.Module):
    """``x * (1 + scale)`` per feature, computed in the buffer's dtype (as a normalisation layer
    computes in its statistics' dtype), so a mixed-precision ``buffer_dtype`` changes the values."""

    scale: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.scale.dtype) * (1 + self.scale)).to(x.dtype)


def _layer(kind: str, width: int) -> nn.Module:
    if kind == "scale":
        return _Scale(width)
    if kind == "linear":
        return nn.Linear(width, width)
    if kind == "norm":
        return nn.LayerNorm(width)
    if kind in ("conv1", "conv3"):
        return _Conv(width, int(kind[-1]))
    raise ValueError(f"unknown layer kind {kind!r}")


class FuzzBlock(nn.Module):
    """``layers`` (tanh after each linear/conv), then the nested block ``inner`` if any (before them where the spec
    says ``inner_first``); ``layers`` under a reentrant checkpoint where the spec says so and the forward records a
    graph for their input."""

    def __init__(self, spec: Block, width: int) -> None:
        super().__init__()
        self.kinds, self.reentrant, self.inner_first = spec.layers, spec.reentrant, spec.inner_first
        self.layers = nn.ModuleList(_layer(kind, width) for kind in spec.layers)
        if spec.tie:
            first, second = [i for i, kind in enumerate(spec.layers) if kind == "linear"][:2]
            self.layers[second].weight = self.layers[first].weight  # type: ignore[union-attr]
        self.inner = FuzzBlock(Block(layers=spec.inner), width) if spec.inner else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is not None and self.inner_first:
            x = self.inner(x)
        if self.reentrant and torch.is_grad_enabled() and x.requires_grad:
            x = checkpoint(self._layers, x, use_reentrant=True)
        else:
            x = self._layers(x)
        return x if self.inner is None or self.inner_first else self.inner(x)

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        for kind, layer in zip(self.kinds, self.layers, strict=True):
            x = layer(x)
            if kind not in ("norm", "scale"):
                x = torch.tanh(x)
        return x


class FuzzModel(nn.Module):
    """The model of a :class:`ModelSpec`; returns one output or ``(output, aux)``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.width) if spec.vocab else None
        self.blocks = nn.ModuleList(FuzzBlock(block, spec.width) for block in spec.blocks)
        self.unused = FuzzBlock(Block(), spec.width) if spec.unused else None
        self.head = nn.Linear(spec.width, spec.vocab or spec.width, bias=not spec.tie_head)
        if spec.tie_head:
            assert self.embed is not None
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = x if self.embed is None else self.embed(x)
        aux = None
        for index, block in enumerate(self.blocks):
            h = block(h)
            if index == 0:
                aux = h
        if self.unused is not None:
            self.unused(h)  # computed, never part of the loss
        out = self.head(h)
        if self.spec.aux_output:
            assert aux is not None
            return out, aux
        return out


def holds_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter (a block of ``scale`` layers holds buffers only): a unit of it would
    gather nothing."""
    return any(True for _ in module.parameters())


def build_model(spec: ModelSpec, seed: int, dtype: torch.dtype, device: torch.device) -> FuzzModel:
    """The model, initialised from ``seed``, in ``dtype`` on ``device``; on the meta device it is built there
    (no storage, nothing initialised; moving a built model there would untie its tied weights)."""
    if device.type == "meta":
        with device:
            return FuzzModel(spec).to(dtype=dtype)
    model = FuzzModel(spec)
    seeded_init_(model, seed)
    return model.to(device=device, dtype=dtype)


def make_batch(spec: ModelSpec, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One input batch from ``seed``: token ids, or dense activations in ``dtype``."""
    if spec.vocab:
        return torch.randint(0, spec.vocab, (BATCH, SEQ), generator=generator(seed)).to(device)
    return dense_batch(spec.width, seed, dtype, device)


def dense_batch(width: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One batch of dense ``(BATCH, SEQ, width)`` activations from ``seed``, in ``dtype``."""
    return torch.randn((BATCH, SEQ, width), generator=generator(seed)).to(device=device, dtype=dtype)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A low-precision output in float32 (as ``fixtures.precision.low_precision_loss``), else as is."""
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


def loss_of(output: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A scalar loss using every returned output (mean of squares; the aux output at half weight),
    in float32 for low-precision outputs."""
    if isinstance(output, tuple):
        main, aux = output
        return _full(main).pow(2).mean() + 0.5 * _full(aux).pow(2).mean()
    return _full(output).pow(2).mean()
