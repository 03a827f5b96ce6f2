"""The mutant base: the reference adapter with one behaviour broken (see ``conformance.mutants``)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from conformance.adapters.base import WrapSpec
from conformance.adapters.reference import ReferenceAdapter

__all__ = ["_Mutant"]


class _Mutant(ReferenceAdapter):
    breaks = ""

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        self._patch_globally()
        model = super().wrap(module, self._mutate_spec(spec))
        for unit in self._api().FullyShardedDataParallel.fsdp_modules(model):
            self._mutate_unit(unit)
        return model

    def _patch_globally(self) -> None:
        """Module-level patches (idempotent)."""

    def _mutate_spec(self, spec: WrapSpec) -> WrapSpec:
        return spec

    def _mutate_unit(self, unit: Any) -> None:
        """Per-unit breakage."""
