"""Forward-order checking across ranks and across iterations, and the recorded order prefetch uses.

[Note: execution order]
Units must all-gather in the same order on every rank, or collectives pair up
wrongly (two units with equal flat sizes would even "succeed"). The root records
the order in which units run their pre-forward during the first training
iteration; forward and backward prefetch follow that recorded order. When
``torch.distributed``'s debug level is DETAIL, checking is on, as in torch:

* first iteration: before a unit all-gathers, every rank all-gathers the unit's
  index; a mismatch raises ``RuntimeError("Forward order differs across ranks:
  ...")`` naming what each rank gathers, on every rank (so no rank hangs);
* later iterations: each rank compares with its own first-iteration order and
  warns once, on the deviating rank only, then stops checking.

Eval-mode forwards (``module.training`` False) are neither checked nor
recorded, and an iteration ends at the end of backward, so train/eval switches
never warn.
"""

from __future__ import annotations

import enum
import itertools
import warnings
from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from fsdp_impl import collectives
from fsdp_impl.flat_param import FlatParamHandle

__all__ = ["ExecOrderData", "OrderedUnit", "checking_enabled"]


class OrderedUnit(Protocol):
    """What order checking reads of a unit (``fsdp_impl.unit_state.UnitState`` has it)."""

    @property
    def handle(self) -> FlatParamHandle | None: ...

    @property
    def fqn_prefix(self) -> str: ...

    @property
    def compute_device(self) -> torch.device: ...


U = TypeVar("U", bound=OrderedUnit)


def checking_enabled() -> bool:
    """Whether cross-rank order checks run (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)."""
    try:
        return dist.get_debug_level() == dist.DebugLevel.DETAIL
    except (AttributeError, RuntimeError):
        return False


class _Warn(enum.Enum):
    NONE = enum.auto()
    WARNING = enum.auto()
    WARNED = enum.auto()


class ExecOrderData(Generic[U]):
    """Shared by every unit of one root: the recorded order and the checking state."""

    def __init__(self, units: list[U], group: dist.ProcessGroup | None) -> None:
        self.units = [unit for unit in units if unit.handle is not None]
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = collectives.group_size(group)
        self.checking = checking_enabled()
        self.iteration = 0
        self.forward_order: list[U] = []
        self.current_index = 0
        self.warn_status = _Warn.NONE

    @property
    def is_first_iter(self) -> bool:
        return self.iteration == 0

    def record_pre_forward(self, unit: U, is_training: bool) -> None:
        """Check ``unit`` against the expected order, then record it (first iteration only)."""
        if unit.handle is None:
            return
        if is_training and self.checking:
            self._check(unit)
        if is_training and self.is_first_iter and unit not in self.forward_order:
            self.forward_order.append(unit)

    def next_iter(self) -> None:
        """End of backward: later forwards compare against the first iteration's order."""
        self.iteration += 1
        self.current_index = 0
        if self.warn_status is _Warn.WARNING:
            self.warn_status = _Warn.WARNED

    def abort_iter(self) -> None:
        """An exception ended the iteration early: the next forward starts over, and records the order
        again when the aborted iteration was the first."""
        self.current_index = 0
        if self.is_first_iter:
            self.forward_order.clear()

    def next_forward(self, unit: U) -> U | None:
        """The unit recorded after ``unit`` in forward (prefetch target), from the second iteration on."""
        return None if self.is_first_iter else self._neighbour(unit, +1)

    def next_backward(self, unit: U) -> U | None:
        """The unit recorded before ``unit`` in forward, i.e. next in backward; in the first iteration too,
        whose forward has recorded it by then (as torch's FSDP1 prefetches in its first backward)."""
        return self._neighbour(unit, -1)

    def _neighbour(self, unit: U, step: int) -> U | None:
        if unit not in self.forward_order:
            return None
        index = self.forward_order.index(unit) + step
        return self.forward_order[index] if 0 <= index < len(self.forward_order) else None

    # -- checks -------------------------------------------------------------------------
    def _names(self, index: int) -> list[str]:
        unit = self.units[index]
        assert unit.handle is not None
        return [f"{unit.fqn_prefix}{slot.fqn}" for slot in unit.handle.slots]

    def _check(self, unit: U) -> None:
        if self.is_first_iter:
            self._check_across_ranks(unit)
        else:
            self._check_against_first_iter(unit)

    def _check_across_ranks(self, unit: U) -> None:
        device = unit.compute_device
        local = torch.tensor([self.units.index(unit)], dtype=torch.int32, device=device)
        world = torch.zeros(self.world_size, dtype=torch.int32, device=device)
        collectives.all_gather(world, local, self.group).wait()
        indices = world.cpu().tolist()
        for (r1, i1), (r2, i2) in itertools.combinations(enumerate(indices), 2):
            if i1 != i2:
                raise RuntimeError(
                    f"Forward order differs across ranks: rank {r1} is all-gathering parameters "
                    f"for {self._names(i1)} while rank {r2} is all-gathering parameters for "
                    f"{self._names(i2)}"
                )

    def _check_against_first_iter(self, unit: U) -> None:
        if self.warn_status is _Warn.WARNED:
            return
        detail = None
        names = self._names(self.units.index(unit))
        if self.current_index >= len(self.forward_order):
            detail = (
                "Expected to not all-gather any more parameters in the forward but trying "
                f"to all-gather parameters for {names}"
            )
        elif self.forward_order[self.current_index] is not unit:
            expected = self._names(self.units.index(self.forward_order[self.current_index]))
            detail = (
                f"Expected to all-gather for {expected} but trying to all-gather "
                f"parameters for {names}"
            )
        if detail is not None:
            warnings.warn(
                f"Forward order differs from that of the first iteration on rank {self.rank}. "
                f"Collectives are unchecked and may give incorrect results or hang.\n{detail}",
                stacklevel=4,
            )
            self.warn_status = _Warn.WARNING
        self.current_index += 1
