"""The collectives a backward issues: what resharding after forward and backward prefetch promise.

[Note: all-gathers in backward]
Where parameters are resharded after forward decides what backward must gather
again, and torch documents it: ``SHARD_GRAD_OP`` (and its hybrid form) and
``fully_shard(reshard_after_forward=False)`` keep the unsharded parameters from
forward to backward ("no all-gather in backward", the point of ZeRO-2), as does
``set_reshard_after_forward(False)``, which changes that argument "at runtime"
(``SetReshardAfterForward``, per unit: the program follows each unit's setting), and an int
``reshard_after_forward`` keeps each unit sharded over that many ranks, from
which backward gathers it again. So, recording the collectives a rank issues
during a backward (``harness.collectives.recorder``, the same layer the cases read), a
program checks that

- keeping strategies, and every unit's resharding after forward turned off,
  issue no all-gather in backward; with it off on some units only, no
  all-gather over the whole world in backward is of the bytes a rank sends to
  gather one of those units (a unit told by its size as [Note: prefetch lists
  in order] tells it, judged where no other unit may send as many);
- under an int ``reshard_after_forward`` every all-gather in backward is over a
  group of that many ranks, and there is one where a unit below the root with a
  trainable parameter takes part in the loss (its backward needs its parameters);
- backward prefetches, which is the default of both APIs (FSDP1's
  ``backward_prefetch=BACKWARD_PRE``, which the contract's ``WrapSpec`` keeps unless
  told otherwise, and FSDP2's implicit prefetch of the next module in reverse
  post-forward order): where backward issues two or more all-gathers, the second
  comes before the first reduce-scatter (the next unit was gathered before this
  unit's gradient was reduced; without prefetch each unit's all-gather waits for
  the previous unit's reduction to be issued);
- a hybrid program ([Note: hybrid programs] in :mod:`conformance.fuzz.wrapping`)
  gathers and reduce-scatters over the very shard group object it was given
  (told apart by its c10d name from a new group of the same ranks, which would
  lose what the user built the group with: its backend, options, timeout).

Only a backward whose pending loss came from one forward with gradients and
nothing else is judged: a forward without gradients, a state dict taken or a
per-module control used in between may legitimately reshard what backward then
gathers, and so may a second forward (torch's FSDP2 reshards a unit after its
backward through the first forward's graph and gathers it again for the second's).
Collectives are recorded on more than one rank only, and not from a program's
first per-module control on (but ``SetReshardAfterForward`` and
``GradientDivideFactor``, which the checks model).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from conformance.fuzz.drawn_precision import dtype_of
from conformance.fuzz.held import shard_sizes, units_of
from conformance.fuzz.ops import FullyShardConfig, ProgramConfig, WrapConfig
from harness.collectives.observe import group_name
from harness.collectives.recorder import Call, describe, patch_collectives

__all__ = ["GATHERS", "REDUCTIONS", "Gathers", "assert_backward_prefetched", "promise"]

#: The ops a recorded all-gather is (``harness.collectives.recorder`` names them so).
GATHERS = ("all_gather_into_tensor", "all_gather")
REDUCTIONS = ("reduce_scatter_tensor", "reduce_scatter")
KEEPING = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")  # the strategies that keep parameters from forward to backward


def promise(config: ProgramConfig, after_forward: Mapping[str, bool | int] | None = None) -> str | int | None:
    """``"none"``: backward gathers nothing; an int: it gathers over groups of that many ranks; ``None``: no
    promise this note checks (resharding strategies, one rank). ``after_forward``: units whose
    ``set_reshard_after_forward`` changed their setting."""
    if config.world_size == 1:
        return None
    if isinstance(config, FullyShardConfig):
        settings = {(after_forward or {}).get(unit, config.reshard_after_forward) for unit in config.units()}
        if True in settings:  # a resharding unit may gather anything
            return None
        ints = settings - {False}
        return "none" if not ints else ints.pop()
    return "none" if isinstance(config, WrapConfig) and config.strategy in KEEPING else None


def _needs_gather(model: nn.Module, config: ProgramConfig, kept: Collection[str] = ()) -> bool:
    """Whether a unit below the root with a trainable parameter takes part in the loss (not the unused block), but
    those in ``kept``."""
    return any(unit and not unit.startswith("unused") and any(p.requires_grad for p in params)
               for unit, params in units_of(model, config).items() if unit not in (*config.ignored, *kept))


@dataclass
class Gathers:
    """The check of one program on this rank ([Note: all-gathers in backward])."""

    config: ProgramConfig
    model: nn.Module  # the shadow's, unsharded
    expected: str | int | None = None
    clean: bool = False  # the pending loss came from one forward with gradients alone
    shard_group: Any = None  # the shard group a hybrid program was given
    calls: list[Call] | None = None  # the all-gathers and reduce-scatters of the last judged backward, until checked
    kept: list[str] = field(default_factory=list)  # units set_reshard_after_forward(False) keeps gathered
    judged: bool = True  # False once a per-module control was used

    def __post_init__(self) -> None:
        self.expected = promise(self.config)

    def started(self) -> None:
        """A forward with gradients began a pending loss (see the note)."""
        self.clean = True

    def disturbed(self) -> None:
        """Something between forward and backward may reshard (see the note)."""
        self.clean = False

    def stop(self) -> None:
        """No more checks in this program (it used a per-module control)."""
        self.judged = False

    def reshards_after_forward(self, after_forward: Mapping[str, bool | int]) -> None:
        """``set_reshard_after_forward`` changed units' settings (see the note); a pending loss's forward ran
        under the old ones."""
        self.expected, self.clean = promise(self.config, after_forward), False
        default = self.config.reshard_after_forward if isinstance(self.config, FullyShardConfig) else True
        self.kept = [unit for unit in self.config.units() if after_forward.get(unit, default) is False]

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Record the block's all-gathers where this backward is judged (for :meth:`check`)."""
        judged, self.clean = self.judged and self.clean and self.config.world_size > 1, False
        if not judged:
            yield
            return
        calls: list[Call] = []

        def recorded(op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if op in GATHERS + REDUCTIONS:
                calls.append(describe(op, fn, args, kwargs))
            return fn(*args, **kwargs)

        with patch_collectives(recorded, barrier=False):  # rank processes and thread hosts keep them installed
            yield
        self.calls = calls

    def check(self) -> None:
        """The all-gathers of the last judged backward keep the promise (see the note); then forget them."""
        calls, self.calls = self.calls, None
        if calls is None:
            return
        assert_backward_prefetched(calls)
        if self.shard_group is not None:
            _check_given_group(calls, group_name(self.shard_group))
        sizes = [len(call.group_ranks) for call in calls if call.op in GATHERS]
        if self.expected == "none" and sizes:
            raise AssertionError(f"backward issued all-gathers over groups of {sizes} ranks, though "
                                 f"{self._setting()} keeps the unsharded parameters from forward to backward")
        if self.kept:
            self._check_kept(calls)
        if isinstance(self.expected, int):
            other = [size for size in sizes if size != self.expected]
            if other or (not sizes and _needs_gather(self.model, self.config, self.kept)):
                raise AssertionError(
                    f"backward issued all-gathers over groups of {sizes} ranks, though reshard_after_forward="
                    f"{self.expected} keeps each unit sharded over {self.expected} ranks after forward, from which a "
                    "unit taking part in the loss is gathered again")

    def _check_kept(self, calls: list[Call]) -> None:
        """No whole-world all-gather was of the size of a unit set_reshard_after_forward(False) keeps (the note)."""
        world, policy = self.config.world_size, self.config.policy
        size = None if policy is None else dtype_of(policy.param_dtype).itemsize
        units = units_of(self.model, self.config)
        sizes = {unit: set(shard_sizes(params, world, size)) for unit, params in units.items()
                 if unit not in self.config.ignored}
        told = {bytes_: unit for unit in self.kept if unit in sizes
                for bytes_ in sizes[unit] - set().union(*(s for other, s in sizes.items() if other != unit))}
        again = sorted({told[call.bytes] or "<root>" for call in calls
                        if call.op in GATHERS and len(call.group_ranks) == world and call.bytes in told})
        if again:
            raise AssertionError(f"backward all-gathered {again} again over the whole world, though "
                                 "set_reshard_after_forward(False) keeps their unsharded parameters after forward")

    def _setting(self) -> str:
        if isinstance(self.config, WrapConfig):
            return self.config.strategy
        return "reshard_after_forward=False"


def _check_given_group(calls: list[Call], given: str) -> None:
    """Every collective was over the shard group given (see the note)."""
    other = sorted({f"{call.group_name} (ranks {list(call.group_ranks)})" for call in calls
                    if call.group_name != given})
    if other:
        raise AssertionError(f"backward issued collectives over groups {', '.join(other)}, not the shard group object "
                             f"given ({given}): a group of the same ranks made anew is not the user's")


def assert_backward_prefetched(calls: list[Call]) -> None:
    """Backward prefetch (see the note): of two or more all-gathers, the second precedes the first reduce-scatter."""
    order = ["all-gather" if call.op in GATHERS else "reduce-scatter" for call in calls]
    gathers = [index for index, op in enumerate(order) if op == "all-gather"]
    if len(gathers) >= 2 and "reduce-scatter" in order and order.index("reduce-scatter") < gathers[1]:
        raise AssertionError(f"backward issued {', '.join(order)}: the second all-gather only after the first "
                             "reduce-scatter, so nothing was prefetched (backward prefetch is the default)")
