"""The stateful fuzzer's programs as plain data: a configuration and a sequence of public operations.

[Note: stateful programs]
A :class:`Program` is a configuration of one of two kinds, by the API that
shards the model (:mod:`conformance.fuzz.configs`): a :class:`WrapConfig`
(``wrap`` units: strategy, offload, ``use_orig_params``) or a
:class:`FullyShardConfig` (``fully_shard`` bottom-up: ``reshard_after_forward``,
a model built on the meta device), both with a model, wrap plan, precision,
activation checkpointing and frozen blocks; and a tuple of operations a
user performs on the sharded model, in order: forwards with and without
gradients, ``train()``/``eval()``, backward, optimizer step, a whole training iteration,
``zero_grad(set_to_none=...)``, saving model and optimizer state and loading
the last save, a backward inside the adapter's optional ``no_sync``, clipping the
gradients to a total norm and scaling the full parameters in place; on a wrapped model
also reading a unit's full parameters with ``summon_full_params``'s options, on a
``fully_shard``-ed model FSDP2's per-module controls ([Note: fully_shard
programs] in :mod:`conformance.fuzz.controls`). Like a
parity example ([Note: fuzz examples are plain data]) a program holds only
ints, floats, strings, booleans, tuples and dataclasses of them: it is drawn on rank 0,
sent to every rank, and its ``source`` is the reproducer's body.

Every operation is valid after any prefix, so hypothesis may delete any of them
while shrinking: a backward with no loss pending, a load with nothing saved
and an optimizer step between a forward and its backward (no training loop
steps there, and the pending graph would see parameters it did not compute
with) do nothing, on both sides, as do a clip with no gradients (or
with gradients kept unsynchronised) and a write to the parameters while a
loss is pending. A load abandons a pending loss, as rolling
back an iteration does. Operations an adapter lacks (``no_sync``, optimizer
state dicts on thread ranks, FSDP1's ``clip_grad_norm_`` and ``apply``, ...) are skipped the same way and counted.

Configuration is drawn the way the parity fuzzer draws policies: every choice
first, then what the implementation cannot express is dropped
(:func:`conformance.fuzz.drawing.programs`), so one seed draws the same operations for every adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conformance.fuzz.configs import (
    APIS,
    FEATURES,
    FULLY_SHARD_FEATURES,
    HYBRID_OF,
    NODE,
    STRATEGIES,
    Config,
    FullyShardConfig,
    ProgramConfig,
    WrapConfig,
    hybrid_fits,
)

__all__ = [
    "APIS", "FEATURES", "FULLY_SHARD_FEATURES", "BATCHES", "STRATEGIES", "HYBRID_OF", "NODE", "hybrid_fits",
    "Config", "WrapConfig", "FullyShardConfig", "ProgramConfig", "Forward", "Backward", "Step", "ZeroGrad",
    "Mode", "Save", "Load", "NoSync", "Unshard", "Reshard", "GradSync", "ReshardAfterBackward", "Prefetch",
    "SetReshardAfterForward", "GradientDivideFactor", "CONTROL_OPS", "MODELLED_CONTROLS", "Op", "Program", "Train",
    "ClipGradNorm", "ScaleParams", "SummonFull", "WRAP_OPS",
]

#: Distinct input batches a program draws from (per rank), so a repeated forward sees the same batch.
BATCHES = 3


@dataclass(frozen=True)
class Forward:
    """``model(batch)``; ``grad=False`` under ``torch.no_grad()``. With gradients the loss is kept
    for the next backward (added to a loss already pending); ``loss="main"`` leaves the auxiliary
    output out of it (an unused output)."""

    batch: int = 0
    grad: bool = True
    loss: str = "all"

    def __post_init__(self) -> None:
        if not 0 <= self.batch < BATCHES or self.loss not in ("all", "main"):
            raise ValueError(f"Forward(batch={self.batch}, loss={self.loss!r}): batch in [0, {BATCHES}), "
                             "loss 'all' or 'main'")


@dataclass(frozen=True)
class Backward:
    """``loss.backward()`` of the pending loss (nothing pending: nothing happens)."""


@dataclass(frozen=True)
class Step:
    """``optimizer.step()`` (skipped while a loss is pending: see [Note: stateful programs])."""


@dataclass(frozen=True)
class Train:
    """One training iteration: a :class:`Forward` of ``batch`` with gradients (added to a loss already
    pending), its :class:`Backward`, then a :class:`Step`."""

    batch: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.batch < BATCHES:
            raise ValueError(f"Train(batch={self.batch}): batch in [0, {BATCHES})")


@dataclass(frozen=True)
class ZeroGrad:
    """``optimizer.zero_grad(set_to_none=...)``."""

    set_to_none: bool = True


@dataclass(frozen=True)
class Mode:
    """``model.train()`` or ``model.eval()``."""

    train: bool = False


@dataclass(frozen=True)
class Save:
    """Save the model's state dict (``sharded``: each rank's shards, else the full one) and, with
    ``optim``, the optimizer's; a full save is compared with the shadow's."""

    sharded: bool = False
    optim: bool = True


@dataclass(frozen=True)
class Load:
    """Load what the last :class:`Save` saved (nothing saved: nothing happens)."""


@dataclass(frozen=True)
class NoSync:
    """A forward and backward of ``batch`` inside the adapter's ``no_sync``, then one of the next batch
    outside it (the synchronizing backward), as gradient accumulation uses it. Skipped while a loss
    is pending."""

    batch: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.batch < BATCHES:
            raise ValueError(f"NoSync(batch={self.batch}): batch in [0, {BATCHES})")


@dataclass(frozen=True)
class ClipGradNorm:
    """Clip the gradients to total norm ``max_norm``: a wrapped model's own ``clip_grad_norm_(max_norm,
    norm_type)`` (the adapter's optional ``clip_grad_norm``), a ``fully_shard``-ed one's
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)``. On the shadow: the
    ``norm_type``-norm of every full gradient as one vector is returned, and where it exceeds ``max_norm`` every
    gradient is scaled by ``max_norm / (total + 1e-6)`` (torch's ``clip_grad_norm_``); the returned norm must
    equal the shadow's. Nothing happens, on both sides, while a loss is pending, while gradients are kept
    unsynchronised (``GradSync(on=False)``) and when the shadow has no gradient. The infinity norm is kept only
    where no rank's piece of a gradient can be empty (a ``wrap`` program with flat parameters, or one rank):
    torch's norms refuse it on an empty tensor whatever the implementation ("no identity"), so elsewhere the
    2-norm stands for it."""

    max_norm: float = 0.01
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        if not self.max_norm > 0 or self.norm_type not in (2.0, float("inf")):
            raise ValueError(f"ClipGradNorm(max_norm={self.max_norm}, norm_type={self.norm_type}): a positive "
                             "max_norm, norm_type 2.0 or inf")


@dataclass(frozen=True)
class ScaleParams:
    """Multiply every full parameter by ``scale`` in place, where a user writes full parameters: a wrapped model's
    ``apply(fn)`` (the adapter's optional ``apply_with_full_params``; FSDP1's gathers the full parameters and
    writes them back, ``summon_full_params(writeback=True)``), ``fn`` scaling each module's own parameters; a
    ``fully_shard``-ed model's ``p.mul_(scale)`` on each of ``model.parameters()`` (DTensors) under
    ``torch.no_grad()``, after ``reshard()`` on every sharded module: one that does not reshard after forward (or
    backward) keeps its gathered parameters and computes the next forward with them, so the user drops them first
    (without FSDP2's ``reshard()`` in the adapter, the operation is skipped). On the shadow: every parameter is
    multiplied by ``scale``. The next forward's outputs and the full parameters must equal the shadow's. Nothing
    happens, on both sides, while a loss is pending (its graph computed with the values before)."""

    scale: float = 0.5

    def __post_init__(self) -> None:
        if self.scale == 0:
            raise ValueError("ScaleParams(scale=0): a nonzero scale")


@dataclass(frozen=True)
class SummonFull:
    """Read the full parameters of the wrapped module at ``unit`` (``""``: the root) inside FSDP1's
    ``summon_full_params(module, recurse, writeback=False, rank0_only, offload_to_cpu, with_grads)`` (the
    adapter's optional ``summoned_params``), as a user inspects a submodule. torch 2.13 documents: the full
    parameters of every unit in the module's tree (``recurse=False``: of the module's own unit alone); with
    ``rank0_only`` on global rank 0 only ("the other ranks will have sharded parameters"); with
    ``offload_to_cpu`` on the CPU where the unit is sharded; with ``with_grads`` their gradients too, "only
    supported when passing use_orig_params=True ... and offload_to_cpu=False". Where torch leaves an option
    unsupported (``with_grads`` without ``use_orig_params`` or beside an offload, ``offload_to_cpu`` on a unit
    that does not shard: ``NO_SHARD`` or one rank) the program runs without it. On the shadow: each parameter
    the call summons (below ``unit``, less any nested unit's without ``recurse``; a tied parameter, owned by
    whichever unit the implementation chose, is left out) equals the shadow's, and with ``with_grads`` so does
    its gradient, on every rank that sees full parameters; an offloaded one is on the CPU. Nothing happens, on
    both sides, while a loss is pending (summoning inside forward and backward is refused by torch)."""

    unit: str = ""
    recurse: bool = True
    rank0_only: bool = False
    offload_to_cpu: bool = False
    with_grads: bool = False


@dataclass(frozen=True)
class Unshard:
    """``unshard()`` of the ``fully_shard``-ed module at ``unit`` (``""``: the root), with ``async_op``
    waiting on the handle it returns, then a forward of ``batch`` with gradients (as :class:`Forward`)
    that uses the gathered parameters."""

    unit: str = ""
    async_op: bool = False
    batch: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.batch < BATCHES:
            raise ValueError(f"Unshard(batch={self.batch}): batch in [0, {BATCHES})")


@dataclass(frozen=True)
class Reshard:
    """``reshard()`` of the ``fully_shard``-ed module at ``unit`` (``""``: the root)."""

    unit: str = ""


@dataclass(frozen=True)
class GradSync:
    """``set_requires_gradient_sync(on)`` on the root (every unit): with ``on=False`` backward keeps
    each rank's gradient unreduced until a backward with it on."""

    on: bool = False


@dataclass(frozen=True)
class ReshardAfterBackward:
    """``set_reshard_after_backward(on)`` on the root (every unit): with ``on=False`` backward keeps the
    unsharded parameters for the next forward."""

    on: bool = False


@dataclass(frozen=True)
class Prefetch:
    """Explicit prefetch lists: every unit, in forward order, all-gathers the next ``forward`` units
    after its own in forward, and the ``backward`` units before it (in reverse) after its own in backward."""

    forward: int = 1
    backward: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.forward <= 2 and 0 <= self.backward <= 2):
            raise ValueError(f"Prefetch(forward={self.forward}, backward={self.backward}): each in [0, 2]")


@dataclass(frozen=True)
class SetReshardAfterForward:
    """``set_reshard_after_forward(on, recurse=recurse)`` of the ``fully_shard``-ed module at ``unit`` (``""``: the
    root). torch 2.13 (``FSDPModule.set_reshard_after_forward``): it "sets if the module should reshard parameters
    after forward", changing "the ``reshard_after_forward`` FSDP arg at runtime" (e.g. off "for running evals and
    set back to ``True`` for training"), for "all FSDP submodules or just the passed-in module" (``recurse``).
    No value changes; what a forward leaves gathered does: a module with it off is not gathered again in the
    backward that follows and may hold its unsharded parameters after a forward, and turning it on again frees
    them after the next ([Note: all-gathers in backward], [Note: memory held between iterations])."""

    unit: str = ""
    on: bool = False
    recurse: bool = True


@dataclass(frozen=True)
class GradientDivideFactor:
    """``set_gradient_divide_factor(factor)`` of the ``fully_shard``-ed module at ``unit`` (``""``: the root).
    torch 2.13 (``FSDPModule.set_gradient_divide_factor``): "a custom divide factor for the gradient reduction",
    set on the module's own parameter groups only (not recursive): their reduce-scatter divides the sum over ranks
    by ``factor`` instead of the world size, in the reduce dtype (``foreach_reduce``), then casts to the
    parameters' dtype, as without a factor ([Note: the shadow model])."""

    factor: float = 1.0
    unit: str = ""

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"GradientDivideFactor(factor={self.factor}): a positive factor")


Op = Forward | Backward | Step | Train | ZeroGrad | Mode | Save | Load | NoSync | ClipGradNorm | ScaleParams | \
    SummonFull | Unshard | Reshard | GradSync | ReshardAfterBackward | Prefetch | SetReshardAfterForward | \
    GradientDivideFactor
#: Operations only a ``fully_shard``-ed model has.
CONTROL_OPS = (Unshard, Reshard, GradSync, ReshardAfterBackward, Prefetch, SetReshardAfterForward, GradientDivideFactor)
#: The controls whose effect the program's checks model ([Note: fully_shard programs]); the others end them.
MODELLED_CONTROLS = (SetReshardAfterForward, GradientDivideFactor)
#: Operations only a wrapped (``wrap``) model has.
WRAP_OPS = (SummonFull,)
#: Operations naming one sharded module.
_ON_A_UNIT = (Unshard, Reshard, SetReshardAfterForward, GradientDivideFactor, SummonFull)


@dataclass(frozen=True)
class Program:
    """A configuration and the operations run on it, in order."""

    config: ProgramConfig
    ops: tuple[Op, ...] = ()

    def __post_init__(self) -> None:
        units = self.config.units()
        for op in self.ops:
            if isinstance(op, CONTROL_OPS) and not isinstance(self.config, FullyShardConfig):
                raise ValueError(f"{op} needs a FullyShardConfig")
            if isinstance(op, WRAP_OPS) and not isinstance(self.config, WrapConfig):
                raise ValueError(f"{op} needs a WrapConfig")
            if isinstance(op, _ON_A_UNIT) and op.unit not in units:
                raise ValueError(f"{op} names no sharded module; expected one of {units}")

    def at_world_size(self, world_size: int) -> Program:
        """This program on ``world_size`` ranks: the shadow model follows the world size, so a program written for
        one size is checked at any other its configuration allows ([Note: world sizes])."""
        return replace(self, config=replace(self.config, world_size=world_size))
