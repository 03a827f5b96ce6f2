"""The mutant base: the reference adapter with one behaviour broken (see ``conformance.mutants``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import torch.nn as nn

from conformance.adapters.base import WrapSpec
from conformance.adapters.reference import ReferenceAdapter

__all__ = ["_Mutant", "patch_once"]


class _Mutant(ReferenceAdapter):
    breaks = ""
    #: ``WrapSpec`` fields replaced on every wrap, whatever the case asked for.
    spec_overrides: ClassVar[Mapping[str, Any]] = {}

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        self._patch_globally()
        model = super().wrap(module, self._mutate_spec(spec))
        for unit in self._api().FullyShardedDataParallel.fsdp_modules(model):
            self._mutate_unit(unit)
        return model

    def _patch_globally(self) -> None:
        """Module-level patches (idempotent)."""

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        return replace(spec, **self.spec_overrides) if self.spec_overrides else spec

    def _mutate_unit(self, unit: Any) -> None:
        """Per-unit breakage."""


_patch_lock = threading.Lock()
_patched: set[tuple[int, str]] = set()


def patch_once(owner: Any, attr: str, replacement: Any) -> None:
    """``owner.attr = replacement``, unless it was already patched in this process.

    ``wrap`` runs on every rank; under thread ranks the ranks share one process
    and its modules. The first rank's patch wins, so a replacement that wraps the
    original function is never wrapped around another rank's replacement.
    """
    with _patch_lock:
        if (id(owner), attr) not in _patched:
            setattr(owner, attr, replacement)
            _patched.add((id(owner), attr))
