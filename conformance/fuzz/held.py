"""What a rank's sharded model holds between operations: memory, counted as the storages the rank created.

[Note: memory held between iterations]
Sharding is for memory, so a stateful program also checks the bytes a rank
holds wherever a user could look, after every operation that leaves no loss
pending. After an iteration's backward has synchronised gradients (a
:class:`~conformance.fuzz.ops.Train`, a ``Backward`` that had a loss
pending, a ``NoSync`` pair), every implementation torch documents has freed what
it gathered for the iteration: each unit's unsharded parameters (resharded after
backward, the root included) and its unsharded gradient (reduced to its shard).
What may be held is the sharded state: parameters, gradients and optimizer
state, each no larger than the parameters' shards. So the rank's bytes must stay
within

    ``(1 + D + K) * S + 8 * N + 2 * B + G``

where ``S`` is the bytes of its sharded parameters, ``D`` 1 once a backward has
run (its gradients' shards) and 0 before (when the first ``S`` is what the rank
held right after wrapping where that is more, up to ``2 * S``: room for an
implementation's own bookkeeping),
``K`` the optimizer's copies
of a parameter (SGD's momentum: 1; Adam's two moments: 2;
:data:`~conformance.fuzz.drawn_optimizers.COPIES`), ``N`` the parameters
the optimizer holds (a step count each, a 4-byte tensor in Adam); ``K`` and ``N``
are 0 while the optimizer holds no state (before its first step, except Adagrad's); ``B`` the
model's buffers (kept, perhaps also cast). ``G`` is 0 after such a backward;
after a forward no backward followed (one without gradients, or one a load
abandoned) it is what torch lets a forward leave gathered
(:func:`kept_after_forward`): the root's parameters, every unit's where the
strategy does not reshard after forward, or ``set_reshard_after_forward(False)``
turned it off (``SetReshardAfterForward``: gathered, the shard count times the
padded shard, since a gather joins every rank's padding), and the smaller shards of an int
``reshard_after_forward``, in the policy's param dtype where there is one (what
they are gathered in). Other operations leave ``G`` as it was (turning resharding
on again frees what a forward left gathered only at the next forward or backward).

``S`` is what the rank holds right after wrapping (the implementation's own
layout and padding), but never more than :func:`shard_bound` (every parameter's
shard padded both ways a torch FSDP pads: to a multiple of the shard count along
dim 0, or flattened per unit with each parameter aligned to 16 bytes of the dtype it computes in, the
policy's param dtype where there is one) nor less
than the parameters over the shard count. An implementation that keeps a unit
gathered, or a unit's unsharded gradient, after backward holds a whole unit more
than that.

Bytes are counted by :class:`fixtures.memory.StorageTracker` ([Note: storage
accounting]), active on the rank's own thread from before wrapping to the
program's end: what an implementation allocates on a thread of its own (an
asynchronous collective's worker) is not seen, so the count can only be low,
and nothing an earlier program or row left in the rank process is counted (it
was created before the tracker). A count over the bound is re-taken while a
collective's tensors that the backend's threads have yet to release could
explain the excess ([Note: tensors a backend releases late]), after a cycle
collection (what only a reference cycle keeps alive is garbage, not held).
What the shadow model and the program's saved state dicts hold is not the
implementation's and is left out (every storage reachable from them). Thread ranks with more than one rank are
not checked: torch's threaded group keeps the tensors of a rank's collectives until other threads
have run them, so what a thread holds at a given moment is not its own (a reference program held
96 B more than the bound once, under load, and passed alone). Programs
using FSDP2's per-module controls are not checked from their first control on
(``SetReshardAfterForward`` and ``GradientDivideFactor`` aside, modelled above or
changing no memory): an explicit ``unshard``, ``reshard_after_backward=False`` or
gradient sync turned off keeps unsharded state between operations on purpose.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn

from conformance.fuzz.drawn_optimizers import COPIES
from conformance.fuzz.drawn_precision import dtype_of
from conformance.fuzz.ops import NODE, ProgramConfig, WrapConfig
from fixtures.memory import StorageTracker, kept_alive, settle, storages_of

if TYPE_CHECKING:
    from harness import RankContext

T = TypeVar("T")

__all__ = ["Held", "kept_after_forward", "left_alive", "shard_bound", "shard_sizes", "units_of"]

_STEP_BYTES = 8  # an optimizer's per-parameter step count, at most (Adam's: a float32 tensor)
RESHARDING = ("FULL_SHARD", "HYBRID_SHARD")  # the strategies that reshard a unit after its forward
_ALIGN = 16  # bytes a flat parameter aligns each original parameter to (torch FSDP1 with use_orig_params)


def _shards(config: ProgramConfig) -> int:
    """How many ranks share a parameter: the world, a node of a hybrid strategy, or one without sharding."""
    if not isinstance(config, WrapConfig):
        return config.world_size
    if config.strategy == "NO_SHARD":
        return 1
    return NODE if config.hybrid else config.world_size


def units_of(model: nn.Module, config: ProgramConfig) -> dict[str, list[nn.Parameter]]:
    """``model``'s parameters (the shadow's, unsharded) by the unit, or ignored path, that holds them."""
    units: dict[str, list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        units.setdefault(config.unit_of(name), []).append(param)
    return units


def _padded(params: list[nn.Parameter], shards: int, size: int | None = None) -> int:
    """Bytes of one of ``shards`` shards of ``params`` (one unit's), padded the larger of the note's two ways."""
    return max(shard_sizes(params, shards, size)[1:])


def shard_sizes(params: list[nn.Parameter], shards: int, size: int | None = None, *,
                aligned_in: int | None = None) -> tuple[int, int, int]:
    """Bytes of one of ``shards`` shards of one unit's ``params``: unpadded, and padded each of the note's two
    ways (per parameter to a multiple of the shard count along dim 0; flattened, each parameter aligned), with
    ``size`` bytes an element (``None``: the parameters' own). A flat parameter aligns each parameter to 16 bytes
    of the dtype it computes in, ``aligned_in`` bytes an element (``None``: ``size``): torch's FSDP1 under a
    policy pads its float32 shards by as many elements as 16 bytes of the low-precision dtype hold."""
    size = size or params[0].element_size()
    unpadded = math.ceil(sum(p.numel() for p in params) / shards)
    per_param = sum(math.ceil(_dim0(p) / shards) * (p.numel() // _dim0(p)) for p in params)
    flat = math.ceil(sum(p.numel() + _ALIGN // (aligned_in or size) for p in params) / shards)
    return unpadded * size, per_param * size, flat * size


def shard_bound(model: nn.Module, config: ProgramConfig) -> tuple[int, int]:
    """(least, most) bytes of one rank's parameter shards for ``model`` (unsharded, the shadow's) under
    ``config``: the parameters over the shard count, and the larger of the two paddings in the note;
    ignored parameters count whole."""
    least = most = 0
    aligned_in = None if config.policy is None else dtype_of(config.policy.param_dtype).itemsize
    for unit, params in units_of(model, config).items():
        if unit in config.ignored:
            whole = sum(p.numel() for p in params) * params[0].element_size()
            least, most = least + whole, most + whole
        else:
            unpadded, *padded = shard_sizes(params, _shards(config), aligned_in=aligned_in)
            least, most = least + unpadded, most + max(padded)
    return least, most


def kept_after_forward(model: nn.Module, config: ProgramConfig,
                       after_forward: Mapping[str, bool | int] | None = None) -> int:
    """Bytes of unsharded parameters a forward may leave gathered ([Note: memory held between
    iterations]): the root's (torch's FSDP1 and FSDP2 keep it for the backward that usually follows);
    every unit's where the strategy does not reshard after forward (``SHARD_GRAD_OP``, ``False``, or
    ``after_forward``: a unit's ``set_reshard_after_forward``), each
    the shard count times its padded shard (a gather joins every rank's shard, padding included);
    under an int ``reshard_after_forward`` each other unit's shards over that many ranks too. Under a policy
    they are gathered in its param dtype. On one rank a unit keeps its gathered copy beside the shard only where
    it does not reshard after forward (a gather still writes a buffer of its own; the root is resharded as any
    other unit): FSDP1 switches a one-rank wrap to ``NO_SHARD`` and keeps nothing, FSDP2 does not, so a wrap's
    strategy counts as it does on more ranks. A ``NO_SHARD`` wrap gathers nothing."""
    if isinstance(config, WrapConfig) and config.strategy == "NO_SHARD":
        return 0
    shards = _shards(config)
    default = config.strategy in RESHARDING if isinstance(config, WrapConfig) else config.reshard_after_forward
    size = None if config.policy is None else dtype_of(config.policy.param_dtype).itemsize
    kept = 0
    for unit, params in units_of(model, config).items():
        if unit in config.ignored:
            continue
        raf = (after_forward or {}).get(unit, default)
        if (unit == "" and shards > 1) or raf is False:
            kept += shards * _padded(params, shards, size)  # gathered: every rank's padded shard
        elif not isinstance(raf, bool):
            kept += _padded(params, raf, size)
    return kept


def _dim0(param: torch.Tensor) -> int:
    return param.shape[0] if param.dim() and param.shape[0] else 1


def _tensors_in(value: Any, seen: set[int], out: list[torch.Tensor]) -> None:
    """Every tensor reachable from ``value`` through containers, dataclasses, modules (and their
    parameters' gradients), optimizers' state and sharded tensors' local shards."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        shards = getattr(value, "local_shards", None)  # a ShardedTensor (FSDP1's sharded state dicts)
        if callable(shards):  # has no storage of its own
            children: list[Any] = [shard.tensor for shard in shards()]
        else:
            out.append(value)
            children = [value.grad]
    elif isinstance(value, nn.Module):
        children = [*value.state_dict(keep_vars=True).values(), *(p.grad for p in value.parameters())]
    elif isinstance(value, torch.optim.Optimizer):
        children = list(value.state.values())
    elif isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple)):
        children = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return
    for child in children:
        _tensors_in(child, seen, out)


@dataclass
class Held:
    """The memory check of one program on this rank ([Note: memory held between iterations])."""

    config: ProgramConfig
    tracker: StorageTracker = field(default_factory=lambda: StorageTracker(peak=False))
    shard: int = 0  # S of the note, fixed by :meth:`wrapped`
    kept: int = 0  # what a forward may leave gathered (:func:`kept_after_forward`), fixed by :meth:`wrapped`
    gathered: int | None = 0  # unsharded bytes that may be held now; None: no longer checked
    grads: bool = False  # whether a backward ran: before one there are no gradients to hold
    at_wrap: int = 0  # what the rank held right after wrapping, S unclamped
    since: str = "wrapping"  # what set ``gathered``
    threads: bool = False  # thread ranks: not checked (see the note)
    outside: int = 0  # depth of :meth:`untracked` blocks

    def __post_init__(self) -> None:
        if not self.tracking:
            self.gathered = None

    @property
    def tracking(self) -> bool:
        """Whether the program runs inside the tracker (:meth:`watching`): not on several thread ranks."""
        return not (self.threads and self.config.world_size > 1)

    def watching(self) -> AbstractContextManager[Any]:
        """The tracker where the program is checked; else nothing (tracking costs a dispatch mode per op)."""
        return self.tracker if self.tracking else nullcontext()

    def untracked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` outside the tracker (popped, not only paused, so the fuzzer's own collectives
        run under no Python dispatch mode): the fuzzer's own work, its comparisons and its verdict collectives.
        On torch 2.14.1 a rank has still aborted, rarely, inside such a collective (``DTensor.full_tensor`` in the
        state check: a malloc abort or SIGSEGV, seen in CI and once in about 85 runs of ten passes over the control and
        optimizer programs beside a test-suite run); the dispatch mode was ruled out, the cause is not known."""
        if self.outside or not self.tracking:
            return fn(*args, **kwargs)
        self.tracker.__exit__(None, None, None)
        self.outside += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.outside -= 1
            self.tracker.__enter__()

    def held(self, *others: Any) -> int:
        """Bytes this rank's storages hold, less those reachable from ``others`` (the shadow, saved state)."""
        return self._measure(others)[0]

    def _measure(self, others: tuple[Any, ...]) -> tuple[int, int]:
        """(bytes this rank's storages hold, of which in storages handed to a collective), less those
        reachable from ``others``."""
        tensors: list[torch.Tensor] = []
        for other in others:
            _tensors_in(other, set(), tensors)
        theirs = storages_of(tensors)
        ours = {key: s.nbytes() for key, s in self.tracker.live().items() if key not in theirs}
        communicated = self.tracker.communicated()
        return sum(ours.values()), sum(size for key, size in ours.items() if key in communicated)

    def wrapped(self, shadow_model: nn.Module, *others: Any) -> None:
        """Fix ``S`` from what the rank holds now, just after wrapping (see the note)."""
        least, most = shard_bound(shadow_model, self.config)
        self.at_wrap = self.held(*others)
        self.shard = min(max(self.at_wrap, least), most)
        self.kept = kept_after_forward(shadow_model, self.config)

    def synchronised(self) -> None:
        """A backward that reduced gradients ran: every unit is resharded."""
        self.grads = True
        if self.gathered is not None:
            self.gathered, self.since = 0, "a synchronising backward"

    def forwarded(self) -> None:
        """A forward ran and no backward follows (without gradients, or abandoned by a load)."""
        if self.gathered is not None:
            self.gathered, self.since = self.kept, "a forward with no backward"

    def stop(self) -> None:
        """No more checks in this program (it used a per-module control)."""
        self.gathered = None

    def reshards_after_forward(self, shadow_model: nn.Module, after_forward: Mapping[str, bool | int]) -> None:
        """``set_reshard_after_forward`` changed what the next forward may leave gathered (see the note)."""
        self.kept = kept_after_forward(shadow_model, self.config, after_forward)

    def check(self, optim: torch.optim.Optimizer, buffers: int, *others: Any) -> None:
        """The rank holds no more than the note's bound; ``buffers``: the model's buffer bytes."""
        if self.gathered is None:
            return
        params = sum(len(group["params"]) for group in optim.param_groups) if optim.state else 0
        copies = COPIES[self.config.optimizer] if optim.state else 0  # none before the first step
        grads = int(self.grads)
        first = self.shard if self.grads else min(max(self.shard, self.at_wrap), 2 * self.shard)  # the note on D
        bound = first + (grads + copies) * self.shard + _STEP_BYTES * params + 2 * buffers + self.gathered
        held = settle(lambda: self._measure(others), bound)  # [Note: tensors a backend releases late]
        if held > bound:
            raise AssertionError(
                f"since {self.since} this rank holds {held} B, more than {bound} B: {first} B of sharded parameters "
                f"+ ({grads} gradients + {copies} optimizer copies) x {self.shard} B + {params} step counts + twice "
                f"{buffers} B of buffers + {self.gathered} B a forward may leave gathered ({held - bound} B over: "
                f"a unit kept gathered, or an unsharded gradient kept)")


def left_alive(ctx: RankContext, model: tuple[weakref.ref[nn.Module], ...]) -> str | None:
    """Why the wrapped ``model`` (its modules, held weakly), dropped by the program's end, is still alive once
    the cycle collector has run (``None``: freed), as ``memory/dropped_model_freed`` checks for one model.
    Collective: every rank first passes its collectives (under thread ranks a peer's collective in flight may
    hold this rank's tensors)."""
    ctx.barrier()
    kept = kept_alive(*model)
    if kept is None:
        return None
    return (f"memory held: the wrapped model, dropped at the program's end, is still alive after gc.collect(), "
            f"{kept}: nothing frees its parameters, gradients or process groups")
