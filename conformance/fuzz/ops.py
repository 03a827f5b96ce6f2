"""The stateful fuzzer's programs as plain data: a configuration and a sequence of public operations.

[Note: stateful programs]
A :class:`Program` is a :class:`Config` (model, wrap plan, strategy, precision,
offload, activation checkpointing, frozen blocks, and the API that shards the
model: ``wrap`` units, or ``fully_shard`` bottom-up) and a tuple of operations a
user performs on the sharded model, in order: forwards with and without
gradients, ``train()``/``eval()``, backward, optimizer step, a whole training iteration,
``zero_grad(set_to_none=...)``, saving model and optimizer state and loading
the last save, and a backward inside the adapter's optional ``no_sync``; on a
``fully_shard``-ed model also FSDP2's per-module controls ([Note: fully_shard
programs] in :mod:`conformance.fuzz.controls`). Like a
parity example ([Note: fuzz examples are plain data]) a program holds only
ints, strings, booleans, tuples and dataclasses of them: it is drawn on rank 0,
sent to every rank, and its ``source`` is the reproducer's body.

Every operation is valid after any prefix, so hypothesis may delete any of them
while shrinking: a backward with no loss pending, a load with nothing saved
and an optimizer step between a forward and its backward (no training loop
steps there, and the pending graph would see parameters it did not compute
with) do nothing, on both sides. A load abandons a pending loss, as rolling
back an iteration does. Operations an adapter lacks (``no_sync``, optimizer
state dicts on thread ranks, ...) are skipped the same way and counted.

Configuration is drawn the way the parity fuzzer draws policies: every choice
first, then what the implementation cannot express is dropped
(:func:`conformance.fuzz.drawing.programs`), so one seed draws the same operations for every adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conformance.fuzz.example import (
    DTYPES,
    FUZZ_STRATEGIES,
    OPTIMIZERS,
    ModelSpec,
    Policy,
    exact_low_precision_reduction,
)

__all__ = [
    "APIS", "FEATURES", "FULLY_SHARD_FEATURES", "BATCHES", "STRATEGIES", "HYBRID_OF", "NODE", "hybrid_fits",
    "Config", "Forward", "Backward", "Step", "ZeroGrad",
    "Mode", "Save", "Load", "NoSync", "Unshard", "Reshard", "GradSync", "ReshardAfterBackward", "Prefetch",
    "SetReshardAfterForward", "GradientDivideFactor", "CONTROL_OPS", "MODELLED_CONTROLS", "Op", "Program", "Train",
]

#: How a program shards its model: the adapter's ``wrap`` per unit, or its ``fully_shard`` bottom-up.
APIS = ("wrap", "fully_shard")
#: What a ``fully_shard`` program may draw, each where the adapter declares it: the API itself, an int
#: ``reshard_after_forward``, the per-module controls, explicit prefetch lists, a meta-device model, a
#: mixed-precision policy, ``set_reshard_after_forward``, ``set_gradient_divide_factor``.
FULLY_SHARD_FEATURES = frozenset({"fully_shard", "reshard_after_forward_int", "fully_shard_controls",
                                  "explicit_prefetch", "meta_init", "fully_shard_mixed_precision",
                                  "set_reshard_after_forward", "gradient_divide_factor"})
#: Configuration features an adapter may lack (see :func:`conformance.fuzz.wrapping.features_of`).
FEATURES = frozenset({"mixed_precision", "buffer_dtype", "cast_forward_inputs", "cpu_offload", "hybrid",
                      "keep_low_precision_grads", "ignored_modules"}) | FULLY_SHARD_FEATURES
#: A sharding strategy -> its hybrid counterpart, which shards the same way within a "node" of
#: :data:`NODE` ranks and replicates across nodes (see [Note: hybrid programs]).
HYBRID_OF = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "_HYBRID_SHARD_ZERO2"}
NODE = 2  # ranks per node of a hybrid program; STRATEGIES: every strategy a program may use
STRATEGIES = (*FUZZ_STRATEGIES, *HYBRID_OF.values())
#: Distinct input batches a program draws from (per rank), so a repeated forward sees the same batch.
BATCHES = 3


def hybrid_fits(world_size: int) -> bool:
    """Whether ``world_size`` ranks make several nodes of :data:`NODE` ranks, where a ``wrap`` program may
    draw a hybrid strategy ([Note: hybrid programs] in :mod:`conformance.fuzz.wrapping`)."""
    return world_size > NODE and world_size % NODE == 0


@dataclass(frozen=True)
class Config:
    """What a program runs on. ``wrap``: module paths wrapped as units (then the root); ``checkpoint``:
    blocks whose activations are recomputed in backward (wrapped for activation checkpointing inside
    their unit; a ``wrap`` program's other blocks may checkpoint themselves, ``Block.reentrant``);
    ``frozen``: paths whose parameters have ``requires_grad=False``; ``ignored``: paths given to the root
    as ``ignored_modules`` (to ``fully_shard`` as ``ignored_params``: [Note: ignored modules in programs]).
    ``api``: the paths (then the root) are sharded by the adapter's ``wrap`` or, over a 1-D mesh of the world, by its
    ``fully_shard`` with ``reshard_after_forward`` (then there is no strategy or offload to choose, the
    original parameters are what the module holds, and a policy is FSDP2's: no ``buffer_dtype`` or
    ``keep_low_precision_grads``, given to every ``fully_shard`` call). ``saves_in_iteration`` (``wrap``
    only): each :class:`Train` takes a state dict between its forward and its backward, as a
    checkpointing callback inside the loop would: a full one in the first, a sharded one in the next, and
    so on. ``meta_init`` (``fully_shard`` only): the model is built on the meta device, sharded, then
    materialized with ``to_empty`` and filled with the shadow's values, as a user initializes a model too
    large for one device."""

    world_size: int
    model: ModelSpec = ModelSpec()
    wrap: tuple[str, ...] = ()
    strategy: str = "FULL_SHARD"
    use_orig_params: bool = False
    optimizer: str = "sgd"
    dtype: str = "float32"
    policy: Policy | None = None
    cpu_offload: bool = False
    checkpoint: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    seed: int = 0
    api: str = "wrap"
    reshard_after_forward: bool | int = True
    ignored: tuple[str, ...] = ()
    saves_in_iteration: bool = False
    meta_init: bool = False

    def __post_init__(self) -> None:
        wrappable = self.model.wrappable()
        blocks = tuple(f"blocks.{i}" for i in range(len(self.model.blocks)))
        for name, paths, allowed in (("wrap", self.wrap, wrappable), ("checkpoint", self.checkpoint, blocks),
                                     ("frozen", self.frozen, wrappable)):
            unknown = sorted(set(paths) - set(allowed))
            if unknown:
                raise ValueError(f"Config.{name} names {unknown}, not among {allowed}")
        checks = {"strategy": (self.strategy, STRATEGIES), "optimizer": (self.optimizer, OPTIMIZERS),
                  "dtype": (self.dtype, DTYPES)}
        for name, (value, allowed_values) in checks.items():
            if value not in allowed_values:
                raise ValueError(f"Config.{name}={value!r}; expected one of {allowed_values}")
        if self.world_size < 1:
            raise ValueError(f"Config.world_size must be >= 1, got {self.world_size}")
        if self.hybrid and not hybrid_fits(self.world_size):
            raise ValueError(f"Config(strategy={self.strategy!r}) needs a world of several nodes of {NODE} ranks, "
                             f"got world_size={self.world_size}")
        if self.policy is not None and self.dtype != "float32":
            raise ValueError(f"Config(policy={self.policy}) keeps parameters in float32, got dtype={self.dtype!r}")
        policy = self.policy
        if policy and policy.reduce_dtype is None and not exact_low_precision_reduction(policy, self.world_size):
            raise ValueError(f"Config(world_size={self.world_size}, policy={policy}): give reduce_dtype='float32' "
                             "(see exact_low_precision_reduction)")
        self._check_api()
        if self.ignored and (self.policy is not None or not set(self.ignored) <= set(self.ignorable())):
            raise ValueError(f"Config(ignored={self.ignored}) needs no policy and paths among "
                             f"{self.ignorable()} (see [Note: ignored modules in programs])")
        reentrant = [f"blocks.{i}" for i, block in enumerate(self.model.blocks) if block.reentrant]
        if reentrant and (self.api != "wrap" or set(reentrant) & set(self.checkpoint)):
            raise ValueError(f"Config(api={self.api!r}, checkpoint={self.checkpoint}): reentrant blocks {reentrant} "
                             "are for wrap programs, outside the checkpoint wrapper ([Note: reentrant blocks])")
        if self.frozen and not self.orig_params and not set(self.frozen) <= set(self.wrap):
            raise ValueError(f"Config(frozen={self.frozen}) with flat parameters: a frozen path must be its own "
                             f"unit (wrap={self.wrap}); a flat parameter cannot mix frozen and trained parameters")


    def _check_api(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"Config.api={self.api!r}; expected one of {APIS}")
        raf = self.reshard_after_forward
        if self.api == "wrap":
            if raf is not True or self.meta_init:
                raise ValueError(f"Config(api='wrap', reshard_after_forward={raf!r}, meta_init={self.meta_init}): "
                                 "the strategy decides resharding, and meta_init is fully_shard's")
            return
        plain = dict(strategy="FULL_SHARD", use_orig_params=False, cpu_offload=False, saves_in_iteration=False)
        if any(getattr(self, name) != value for name, value in plain.items()):
            raise ValueError(f"Config(api='fully_shard') takes no strategy, offload, use_orig_params "
                             f"(it keeps the original parameters) or saves_in_iteration: leave them at {plain}")
        if self.policy is not None and (self.policy.buffer_dtype is not None or self.policy.keep_low_precision_grads):
            raise ValueError(f"Config(api='fully_shard', policy={self.policy}): buffer_dtype and "
                             "keep_low_precision_grads are FSDP1's; FSDP2's MixedPrecisionPolicy has neither")
        if not isinstance(raf, bool) and not (1 < raf < self.world_size and self.world_size % raf == 0):
            raise ValueError(f"Config(reshard_after_forward={raf!r}): an int must be a proper factor of the "
                             f"world size {self.world_size}")

    @property
    def hybrid(self) -> bool:
        """Whether the strategy is hybrid (see [Note: hybrid programs])."""
        return self.strategy in HYBRID_OF.values()

    @property
    def orig_params(self) -> bool:
        """Whether the module keeps its original parameters (``use_orig_params``, or ``fully_shard``)."""
        return self.use_orig_params or self.api == "fully_shard"

    def unit_of(self, name: str) -> str:
        """The unit (a wrapped path, else the root ``""``) or the ignored path that holds parameter ``name``."""
        owners = [path for path in (*self.wrap, *self.ignored) if name.startswith(path + ".")]
        return max(owners, key=len, default="")

    def ignorable(self) -> tuple[str, ...]:
        """The paths a program may ignore: frozen modules and the unused block, outside every unit but the
        root and every checkpointed block, outermost only.

        [Note: ignored modules in programs]
        torch documents that the parameters of ``ignored_modules`` are not managed by FSDP: not sharded
        or flattened, and their gradients not reduced, so each rank would train its own copy of a used
        one, which a shadow averaging every gradient cannot stand for. A program ignores only modules
        whose parameters get no gradient on any rank (frozen, or outside the loss), and without a
        mixed-precision policy (which does not apply to them). What it shows: the ignored module keeps
        the user's full parameters on every rank, equal to the shadow's, through training, saving and
        loading, while the rest is sharded and trained around it.
        """
        related = (*self.wrap, *self.checkpoint)
        paths = [p for p in dict.fromkeys((*self.frozen, *(("unused",) if self.model.unused else ())))
                 if not any(p == q or p.startswith(q + ".") or q.startswith(p + ".") for q in related)]
        return tuple(p for p in paths if not any(p.startswith(q + ".") for q in paths))

    def units(self) -> tuple[str, ...]:
        """The sharded modules in forward order: the root (``""``), then the wrapped paths."""
        return ("", *(path for path in self.model.wrappable() if path in self.wrap))


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


Op = Forward | Backward | Step | Train | ZeroGrad | Mode | Save | Load | NoSync | Unshard | Reshard | GradSync | \
    ReshardAfterBackward | Prefetch | SetReshardAfterForward | GradientDivideFactor
#: Operations only a ``fully_shard``-ed model has.
CONTROL_OPS = (Unshard, Reshard, GradSync, ReshardAfterBackward, Prefetch, SetReshardAfterForward, GradientDivideFactor)
#: The controls whose effect the program's checks model ([Note: fully_shard programs]); the others end them.
MODELLED_CONTROLS = (SetReshardAfterForward, GradientDivideFactor)
#: Controls naming one sharded module.
_ON_A_UNIT = (Unshard, Reshard, SetReshardAfterForward, GradientDivideFactor)


@dataclass(frozen=True)
class Program:
    """A configuration and the operations run on it, in order."""

    config: Config
    ops: tuple[Op, ...] = ()

    def __post_init__(self) -> None:
        units = self.config.units()
        for op in self.ops:
            if isinstance(op, CONTROL_OPS) and self.config.api != "fully_shard":
                raise ValueError(f"{op} needs Config(api='fully_shard')")
            if isinstance(op, _ON_A_UNIT) and op.unit not in units:
                raise ValueError(f"{op} names no sharded module; expected one of {units}")

    def at_world_size(self, world_size: int) -> Program:
        """This program on ``world_size`` ranks: the shadow model follows the world size, so a program written for
        one size is checked at any other its configuration allows ([Note: world sizes])."""
        return replace(self, config=replace(self.config, world_size=world_size))
