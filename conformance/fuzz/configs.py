"""A stateful program's configuration, one type per API that shards its model ([Note: stateful programs] in
:mod:`conformance.fuzz.ops`): :class:`WrapConfig` and :class:`FullyShardConfig`, sharing :class:`Config`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from conformance.fuzz.drawn_optimizers import STATEFUL_OPTIMIZERS
from conformance.fuzz.example import (
    DTYPES,
    FUZZ_STRATEGIES,
    ModelSpec,
    Policy,
    exact_low_precision_reduction,
)

__all__ = ["APIS", "FEATURES", "FULLY_SHARD_FEATURES", "STRATEGIES", "HYBRID_OF", "NODE", "hybrid_fits",
           "Config", "WrapConfig", "FullyShardConfig", "ProgramConfig"]

#: How a program shards its model: the adapter's ``wrap`` per unit, or its ``fully_shard`` bottom-up.
APIS = ("wrap", "fully_shard")
#: What a ``fully_shard`` program may draw, each where the adapter declares it: the API itself, an int
#: ``reshard_after_forward``, the per-module controls, explicit prefetch lists, a meta-device model, a
#: mixed-precision policy, ``set_reshard_after_forward``, ``set_gradient_divide_factor``.
FULLY_SHARD_FEATURES = frozenset({"fully_shard", "reshard_after_forward_int", "fully_shard_controls",
                                  "explicit_prefetch", "meta_init", "fully_shard_mixed_precision",
                                  "set_reshard_after_forward", "gradient_divide_factor"})
#: Configuration features an adapter may lack (see :func:`conformance.fuzz.wrapping.features_of`);
#: ``float64``: a model in float64 (where the adapter's ``param_dtypes`` leaves it out, float32 only).
FEATURES = frozenset({"mixed_precision", "buffer_dtype", "cast_forward_inputs", "cpu_offload", "hybrid",
                      "keep_low_precision_grads", "ignored_modules", "float64"}) | FULLY_SHARD_FEATURES
#: A sharding strategy -> its hybrid counterpart, which shards the same way within a "node" of
#: :data:`NODE` ranks and replicates across nodes (see [Note: hybrid programs]).
HYBRID_OF = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "_HYBRID_SHARD_ZERO2"}
NODE = 2  # ranks per node of a hybrid program; STRATEGIES: every strategy a program may use
STRATEGIES = (*FUZZ_STRATEGIES, *HYBRID_OF.values())


def hybrid_fits(world_size: int) -> bool:
    """Whether ``world_size`` ranks make several nodes of :data:`NODE` ranks, where a ``wrap`` program may
    draw a hybrid strategy ([Note: hybrid programs] in :mod:`conformance.fuzz.wrapping`)."""
    return world_size > NODE and world_size % NODE == 0


class _Kinds(type):
    """Calling :class:`Config` itself is the deprecated spelling of a program's configuration: ``api`` picks the
    kind (:class:`WrapConfig` or :class:`FullyShardConfig`), built from the other fields, with a
    ``DeprecationWarning`` naming it; each kind is called as any class."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not Config:
            return super().__call__(*args, **kwargs)
        api = kwargs.pop("api", "wrap")
        kinds: dict[str, type[Config]] = {"wrap": WrapConfig, "fully_shard": FullyShardConfig}
        if api not in kinds:
            raise ValueError(f"Config.api={api!r}; expected one of {APIS}")
        kind = kinds[api]
        warnings.warn(f"Config(api={api!r}, ...) is deprecated: a program's configuration is a {kind.__name__}(...) "
                      "(the same fields, without api)", DeprecationWarning, stacklevel=2)
        return kind(*args, **kwargs)


@dataclass(frozen=True)
class Config(metaclass=_Kinds):
    """What a program runs on, whichever API shards it (:class:`WrapConfig`, :class:`FullyShardConfig`).
    ``wrap``: module paths wrapped as units (then the root); ``checkpoint``: blocks whose activations are
    recomputed in backward (wrapped for activation checkpointing inside their unit; a ``wrap`` program's other
    blocks may checkpoint themselves, ``Block.reentrant``); ``frozen``: paths whose parameters have
    ``requires_grad=False``; ``ignored``: paths given to the root as ``ignored_modules`` (to ``fully_shard`` as
    ``ignored_params``: [Note: ignored modules in programs])."""

    #: How the kind shards its model (of :data:`APIS`), a key of tables that differ by API.
    api: ClassVar[str]

    world_size: int
    model: ModelSpec = ModelSpec()
    wrap: tuple[str, ...] = ()
    optimizer: str = "sgd"
    dtype: str = "float32"
    policy: Policy | None = None
    checkpoint: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    seed: int = 0
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        wrappable = self.model.wrappable()
        blocks = tuple(f"blocks.{i}" for i in range(len(self.model.blocks)))
        for name, paths, allowed in (("wrap", self.wrap, wrappable), ("checkpoint", self.checkpoint, blocks),
                                     ("frozen", self.frozen, wrappable)):
            unknown = sorted(set(paths) - set(allowed))
            if unknown:
                raise ValueError(f"{type(self).__name__}.{name} names {unknown}, not among {allowed}")
        checks = {"optimizer": (self.optimizer, STATEFUL_OPTIMIZERS), "dtype": (self.dtype, DTYPES)}
        for name, (value, allowed_values) in checks.items():
            if value not in allowed_values:
                raise ValueError(f"{type(self).__name__}.{name}={value!r}; expected one of {allowed_values}")
        if self.world_size < 1:
            raise ValueError(f"{type(self).__name__}.world_size must be >= 1, got {self.world_size}")
        if self.policy is not None and self.dtype != "float32":
            raise ValueError(f"{self._named(policy=self.policy)} keeps parameters in float32, got dtype={self.dtype!r}")
        policy = self.policy
        if policy and policy.reduce_dtype is None and not exact_low_precision_reduction(policy, self.world_size):
            raise ValueError(f"{self._named(world_size=self.world_size, policy=policy)}: give reduce_dtype='float32' "
                             "(see exact_low_precision_reduction)")
        if self.ignored and (self.policy is not None or not set(self.ignored) <= set(self.ignorable())):
            raise ValueError(f"{self._named(ignored=self.ignored)} needs no policy and paths among "
                             f"{self.ignorable()} (see [Note: ignored modules in programs])")

    def _named(self, **shown: Any) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    def reentrant(self) -> list[str]:
        """The blocks that checkpoint themselves reentrantly ([Note: reentrant blocks])."""
        return [f"blocks.{i}" for i, block in enumerate(self.model.blocks) if block.reentrant]

    @property
    def hybrid(self) -> bool:
        """Whether the strategy is hybrid (see [Note: hybrid programs]); only a ``wrap`` program's may be."""
        raise NotImplementedError(f"{type(self).__name__} is no kind of program: a WrapConfig or a FullyShardConfig")

    @property
    def orig_params(self) -> bool:
        """Whether the module keeps its original parameters (``use_orig_params``, or ``fully_shard``)."""
        raise NotImplementedError(f"{type(self).__name__} is no kind of program: a WrapConfig or a FullyShardConfig")

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
class WrapConfig(Config):
    """A program whose paths (then the root) are sharded by the adapter's ``wrap``, with ``strategy``,
    ``use_orig_params`` and ``cpu_offload``; its blocks outside the checkpoint wrapper may checkpoint themselves
    reentrantly. ``saves_in_iteration``: each :class:`Train` takes a state dict between its forward and its
    backward, as a checkpointing callback inside the loop would: a full one in the first, a sharded one in the
    next, and so on."""

    api: ClassVar[str] = "wrap"

    strategy: str = "FULL_SHARD"
    use_orig_params: bool = False
    cpu_offload: bool = False
    saves_in_iteration: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy not in STRATEGIES:
            raise ValueError(f"WrapConfig.strategy={self.strategy!r}; expected one of {STRATEGIES}")
        if self.hybrid and not hybrid_fits(self.world_size):
            raise ValueError(f"WrapConfig(strategy={self.strategy!r}) needs a world of several nodes of {NODE} ranks, "
                             f"got world_size={self.world_size}")
        if set(self.reentrant()) & set(self.checkpoint):
            raise ValueError(f"WrapConfig(checkpoint={self.checkpoint}): reentrant blocks {self.reentrant()} are "
                             "outside the checkpoint wrapper ([Note: reentrant blocks])")
        if self.frozen and not self.use_orig_params and not set(self.frozen) <= set(self.wrap):
            raise ValueError(f"WrapConfig(frozen={self.frozen}) with flat parameters: a frozen path must be its own "
                             f"unit (wrap={self.wrap}); a flat parameter cannot mix frozen and trained parameters")

    @property
    def hybrid(self) -> bool:
        return self.strategy in HYBRID_OF.values()

    @property
    def orig_params(self) -> bool:
        return self.use_orig_params


@dataclass(frozen=True)
class FullyShardConfig(Config):
    """A program whose paths (then the root) are sharded by the adapter's ``fully_shard`` over a 1-D mesh of the
    world, with ``reshard_after_forward``: no strategy or offload to choose, the original parameters are what the
    module holds, and a policy is FSDP2's (no ``buffer_dtype`` or ``keep_low_precision_grads``), given to every
    ``fully_shard`` call. ``meta_init``: the model is built on the meta device, sharded, then materialized with
    ``to_empty`` and filled with the shadow's values, as a user initializes a model too large for one device."""

    api: ClassVar[str] = "fully_shard"

    reshard_after_forward: bool | int = True
    meta_init: bool = False

    @property
    def hybrid(self) -> bool:
        return False

    @property
    def orig_params(self) -> bool:
        return True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reentrant():
            raise ValueError(f"FullyShardConfig: reentrant blocks {self.reentrant()} are for wrap programs "
                             "([Note: reentrant blocks])")
        if self.policy is not None and (self.policy.buffer_dtype is not None or self.policy.keep_low_precision_grads):
            raise ValueError(f"FullyShardConfig(policy={self.policy}): buffer_dtype and keep_low_precision_grads are "
                             "FSDP1's; FSDP2's MixedPrecisionPolicy has neither")
        raf, size = self.reshard_after_forward, self.world_size
        if not isinstance(raf, bool) and not (1 < raf < size and size % raf == 0):
            raise ValueError(f"FullyShardConfig(reshard_after_forward={raf!r}): an int must be a proper factor of the "
                             f"world size {size}")


#: A program's configuration: one of the two kinds (what a function branching on the kind takes).
ProgramConfig = WrapConfig | FullyShardConfig
