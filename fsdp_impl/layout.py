"""Where a unit's elements live: the unsharded flat tensor, each rank's local shard, and the
order an all-gather delivers them in.

[Note: shard layouts]
A unit's unsharded flat tensor (``FlatParamHandle.full``) holds its parameters
one after the other, each flattened (*parameter-major*). The layout cuts it into
*blocks*: a block is ``chunk * shard_size`` consecutive elements of which rank
``r`` of the shard group holds ``[r * chunk, (r + 1) * chunk)``, stored at
``shard_offset`` in its local shard. Two layouts exist, one per front door:

* FLAT (``FullyShardedDataParallel``; [Note: flat parameter layout]): all
  parameters, zero-padded at the end to a multiple of the shard-group size, form
  one block, so a rank's shard is one contiguous range that may cut parameters
  anywhere.
* PER_PARAMETER (``fully_shard``; [Note: two front doors]): every parameter is a
  block of its own, zero-padded to ``ceil(dim0 / shard_size)`` rows per rank, so
  a rank's piece of each parameter is whole rows, ``torch.chunk(param,
  shard_size)[r]`` (empty past the last chunk): exactly the local tensor of a
  ``Shard(0)`` DTensor.

An all-gather concatenates the ranks' shards (*rank-major*). With one block that
is the flat tensor itself, so the wrapper gathers straight into it; with several
it is a permutation of it: :meth:`ShardLayout.to_param_major` copies a gathered
tensor out, :meth:`ShardLayout.to_rank_major` copies a gradient in before its
reduce-scatter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["Block", "MeshSharding", "ParamSlot", "ShardLayout", "build_slots", "local_tensor"]


@dataclass
class ParamSlot:
    """One unique original parameter and every (module, attribute) that refers to it."""

    param: nn.Parameter
    fqn: str
    shape: torch.Size
    index: int  # position among the unit's slots (and in its ShardLayout)
    offset: int = 0  # where the parameter starts in the unsharded flat tensor
    registrations: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.shape.numel()


def build_slots(named_params: list[tuple[str, nn.Module, str, nn.Parameter]]) -> list[ParamSlot]:
    """One slot per unique parameter of ``(fqn, module, name, param)`` (shared ones once)."""
    slots: dict[int, ParamSlot] = {}
    dtypes = {param.dtype for _, _, _, param in named_params}
    if len(dtypes) > 1:
        raise ValueError(f"one unit's parameters must share a dtype, got {sorted(map(str, dtypes))}")
    for fqn, module, name, param in named_params:
        slot = slots.get(id(param))
        if slot is None:
            slot = ParamSlot(param, fqn, param.shape, len(slots))
            slots[id(param)] = slot
        slot.registrations.append((module, name))
    return list(slots.values())


@dataclass(frozen=True)
class Block:
    """``chunk * shard_size`` elements of the flat tensor from ``full_offset``; a rank's chunk of
    them sits at ``shard_offset`` in its local shard."""

    full_offset: int
    chunk: int
    shard_offset: int


class MeshSharding(NamedTuple):
    """How ``fully_shard`` presents a local piece: a DTensor on ``mesh`` with ``placements``."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    placements: tuple[Any, ...]  # (Shard(0),) on a 1-D mesh, (Replicate(), Shard(0)) on a 2-D one


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local data: a DTensor's local tensor, else ``tensor`` itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _rows_per_rank(shape: torch.Size, shard_size: int) -> int:
    return -(-shape[0] // shard_size)


class ShardLayout:
    """The blocks of one unit's flat tensor and every parameter's place in them."""

    def __init__(self, shapes: Sequence[torch.Size], shard_size: int, shard_rank: int, per_parameter: bool) -> None:
        self.shapes = list(shapes)
        self.shard_size = shard_size
        self.shard_rank = shard_rank
        self.per_parameter = per_parameter
        self.numel = sum(shape.numel() for shape in self.shapes)
        if per_parameter:
            chunks = [_rows_per_rank(s, shard_size) * math.prod(s[1:]) for s in self.shapes]
        else:
            chunks = [-(-self.numel // shard_size)]
        self.blocks: list[Block] = []
        full = shard = 0
        for chunk in chunks:
            self.blocks.append(Block(full, chunk, shard))
            full, shard = full + chunk * shard_size, shard + chunk
        self.padded_numel = full
        self.shard_numel = shard
        if per_parameter:
            self.offsets = [block.full_offset for block in self.blocks]
        else:
            self.offsets = [sum(s.numel() for s in self.shapes[:i]) for i in range(len(self.shapes))]

    @property
    def gathers_in_place(self) -> bool:
        """Whether rank-major and parameter-major order coincide (one block)."""
        return len(self.blocks) == 1

    def local_range(self, index: int) -> tuple[int, int]:
        """Parameter ``index``'s piece of this rank's shard as ``[lo, hi)`` (empty: ``lo == hi``)."""
        block = self.blocks[index if self.per_parameter else 0]
        start = block.full_offset + self.shard_rank * block.chunk
        offset = self.offsets[index]
        lo = max(offset, start)
        hi = min(offset + self.shapes[index].numel(), start + block.chunk)
        if lo >= hi:
            return (0, 0)
        return (lo - start + block.shard_offset, hi - start + block.shard_offset)

    def local_shape(self, index: int) -> torch.Size:
        """The shape parameter ``index``'s piece is seen in: its rows (PER_PARAMETER), its
        original shape (FLAT over one rank), else 1-D."""
        shape = self.shapes[index]
        lo, hi = self.local_range(index)
        if self.per_parameter:
            rows = _rows_per_rank(shape, self.shard_size)
            held = max(0, min(shape[0] - self.shard_rank * rows, rows))
            return torch.Size([held, *shape[1:]])
        return shape if self.shard_size == 1 else torch.Size([hi - lo])

    def to_rank_major(self, full: torch.Tensor) -> torch.Tensor:
        """A parameter-major tensor (the flat layout) in the order an all-gather delivers it."""
        if self.gathers_in_place:
            return full
        n = self.shard_size
        return torch.cat(
            [full[b.full_offset : b.full_offset + b.chunk * n].view(n, b.chunk) for b in self.blocks], dim=1
        ).view(-1)

    def to_param_major(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Copy an all-gather's output into ``out`` in parameter-major order."""
        rows = gathered.view(self.shard_size, self.shard_numel)
        torch.cat([rows[:, b.shard_offset : b.shard_offset + b.chunk].reshape(-1) for b in self.blocks], out=out)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local shard of a parameter-major tensor (a view when gathering in place)."""
        start = self.shard_rank * self.shard_numel
        return self.to_rank_major(full)[start : start + self.shard_numel]

    def as_dtensor(self, index: int, piece: torch.Tensor, sharding: MeshSharding) -> DTensor:
        """Parameter ``index``'s local ``piece`` as the DTensor ``fully_shard`` exposes (no copy)."""
        shape = self.shapes[index]
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return DTensor.from_local(
            piece, sharding.mesh, sharding.placements, run_check=False, shape=shape, stride=stride
        )
