"""Small models with odd unit sizes (17, 257 elements) for padding-sensitive parity tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from fixtures.seeding import seeded_init_


class Block(nn.Module):
    """``Linear(i, o)`` scaled by an ``extra``-element parameter (``i*o + o + extra`` elements)."""

    def __init__(self, i: int, o: int, extra: int) -> None:
        super().__init__()
        self.lin = nn.Linear(i, o)
        self.scale = nn.Parameter(torch.ones(extra))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * (1 + 0.1 * self.scale.sum())


class OddModel(nn.Module):
    """Blocks of 17, 60 and 257 elements plus a root-owned head (68 elements).

    ``b2_extra``: the middle block's ``scale`` elements (0: an empty parameter,
    which torch 2.13's ``fully_shard`` cannot reduce: ``_chunk_cat expects non-empty tensor``).
    """

    def __init__(self, seed: int = 0, b2_extra: int = 0) -> None:
        super().__init__()
        self.b1 = Block(4, 3, 2)
        self.b2 = Block(3, 15, b2_extra)
        self.b3 = Block(15, 16, 1)
        self.head = nn.Linear(16, 4)
        seeded_init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b3(self.b2(self.b1(x))))


def prefixed(label: str) -> Callable[[str], str]:
    """An ``assert_close`` ``msg`` callable that keeps torch's message after ``label``."""
    return lambda message: f"{label}: {message}"


def batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=gen)
