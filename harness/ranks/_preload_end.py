"""The forkserver imports this just after the task modules: torch's CUDA probes and ``__import__`` are torch's
and Python's again ([Note: preloaded task modules]; ``harness.ranks._preload_begin`` replaced them)."""

from __future__ import annotations

import builtins

import torch

from harness.ranks._preload_begin import REAL_IMPORT, SAVED

for _name, _real in SAVED.items():
    setattr(torch._C, _name, _real)
builtins.__import__ = REAL_IMPORT
