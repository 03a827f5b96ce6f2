"""A DDP-like adapter for the suite's own tests: the reference run with ``NO_SHARD`` only, held as DDP holds it.

Its ``supports_strategy`` accepts only ``None`` (its default) and ``NO_SHARD``, as an honest data-parallel
implementation would, so every row that wraps with a sharding strategy (the default one included) must be
``n/a`` for it, never a FAIL. Its ``wrap`` returns a :class:`DataParallelWrapper` that keeps the sharded model as
``self.module``, the attribute name ``torch.nn.parallel.DistributedDataParallel`` uses: the suite must name the
user's parameters and buffers without relying on a wrapper attribute that starts with ``_``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from conformance.adapters.reference import ReferenceAdapter
from conformance.contract.adapter import Capability, UnitInfo, WrapSpec

__all__ = ["DataParallelWrapper", "DDPLikeAdapter", "REFUSED"]

#: What :meth:`DDPLikeAdapter.wrap` raises with for a strategy it refuses: a row failing with it asked
#: ``wrap`` for a strategy that ``supports_strategy`` would have refused.
REFUSED = "ddp-like refuses strategy"


class DataParallelWrapper(nn.Module):
    """The user's (sharded) model as ``self.module``, forwarding to it, as DDP does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class DDPLikeAdapter:
    """Replicated data parallelism: the reference's ``NO_SHARD`` behind a wrapper holding ``self.module``."""

    name = "ddp-like"
    protocol_version = 2
    capabilities = frozenset({Capability.THREAD_RANKS, Capability.NO_SYNC, Capability.FULL_STATE_DICT,
                              Capability.OPTIM_STATE_DICT, Capability.MIXED_PRECISION,
                              Capability.MP_CAST_FORWARD_INPUTS, Capability.FLAT_PARAM})

    def __init__(self) -> None:
        self._inner = ReferenceAdapter()

    def unavailable_reason(self) -> str | None:
        return self._inner.unavailable_reason()

    def supports_strategy(self, strategy: str | None) -> bool:
        return strategy in (None, "NO_SHARD")

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        """``NO_SHARD`` held as ``self.module``; a wrapper already inside ``module`` (a unit wrapped
        before its parent) gives way to what it holds, so that only the root holds one, as with DDP."""
        if not self.supports_strategy(spec.strategy):
            raise ValueError(f"{REFUSED} {spec.strategy}")
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, DataParallelWrapper):
                    setattr(parent, name, child.module)
        return DataParallelWrapper(self._inner.wrap(module, replace(spec, strategy="NO_SHARD")))

    def wrapped_module(self, model: nn.Module) -> nn.Module:
        return self._inner.wrapped_module(model.module)

    def units(self, model: nn.Module) -> list[UnitInfo]:
        return self._inner.units(model.module)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return self._inner.no_sync(model.module)

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self._inner.full_params(model.module)

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None] | None:
        return self._inner.full_grads(model.module)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return self._inner.full_state_dict(model.module)

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return self._inner.sharded_state_dict(model.module)

    def load_state_dict(self, model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
        self._inner.load_state_dict(model.module, state, sharded=sharded)

    def optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, *, sharded: bool) -> dict[str, Any]:
        return self._inner.optim_state_dict(model.module, optim, sharded=sharded)

    def load_optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], *,
                              sharded: bool) -> None:
        self._inner.load_optim_state_dict(model.module, optim, state, sharded=sharded)
