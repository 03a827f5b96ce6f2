"""The forkserver imports this just after the task modules: torch's CUDA probes work again
([Note: preloaded task modules]; ``harness.ranks._preload_begin`` refused them)."""

from __future__ import annotations

import torch

from harness.ranks._preload_begin import SAVED

for _name, _real in SAVED.items():
    setattr(torch._C, _name, _real)
