"""One FSDP unit as a case sees it (:class:`UnitInfo`, re-exported by :mod:`conformance.contract.adapter`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["UnitInfo"]


@dataclass
class UnitInfo:
    """One FSDP unit as a case sees it.

    ``shard_group`` is the group parameters are sharded over (the replicate
    group is ``None`` unless the strategy is hybrid). ``resharded``: the unit
    holds only the parameter storage it keeps between iterations: its shards,
    every unsharded copy freed; for a strategy that never shards parameters
    (``NO_SHARD``, an engine keeping them whole), its full parameters with no
    other copy beside them (a low-precision one for compute, say). ``None``
    when the implementation cannot tell (no introspection capability).
    ``local_shards`` are this rank's sharded parameter storage (one flat shard
    for flat-parameter implementations, one local tensor per parameter for
    per-parameter sharding) and ``local_grads`` their gradients, aligned.
    ``strategy`` is the unit's own sharding strategy as
    ``conformance.contract.adapter.STRATEGIES`` spells it, or ``None`` when the
    implementation has no per-unit strategy.

    ``empty_shards``, aligned with ``local_shards``, says which of this rank's
    shards hold none of the parameters' elements (zero elements, or padding
    only). Such a shard's gradient says nothing: it may be ``None``, zeros or
    empty whether or not the unit took part in a loss. ``None`` means the
    adapter does not say; a shard of zero elements is then the only empty one.
    Cases read gradients through :meth:`held_grads`, never ``local_grads``
    directly.
    """

    fqn: str
    module: nn.Module
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    compute_device: torch.device | None
    local_shards: list[torch.Tensor]
    local_grads: list[torch.Tensor | None]
    resharded: bool | None
    strategy: str | None = None
    empty_shards: list[bool] | None = None

    def __post_init__(self) -> None:
        if self.empty_shards is not None and len(self.empty_shards) != len(self.local_shards):
            raise ValueError(f"UnitInfo {self.fqn!r}: empty_shards has {len(self.empty_shards)} entries for "
                             f"{len(self.local_shards)} local shards")

    def held_grads(self) -> list[torch.Tensor | None]:
        """The gradients of this rank's shards that hold parameter elements, in order (``None``: no gradient)."""
        empty = self.empty_shards if self.empty_shards is not None else [s.numel() == 0 for s in self.local_shards]
        return [grad for grad, skip in zip(self.local_grads, empty, strict=True) if not skip]
