"""A stateful program on a ``fully_shard``-ed model: sharding it, FSDP2's per-module controls, what a user reads.

[Note: fully_shard programs]
With a ``FullyShardConfig`` the program's model is sharded through the
adapter's optional ``fully_shard`` (a 1-D mesh over the world; the config's
paths bottom-up, each inside its activation-checkpoint wrapper if it has one,
then the root; ``reshard_after_forward`` as drawn). Its operations may then use
the sharded modules' controls (:attr:`Capability.FULLY_SHARD_CONTROLS`,
:attr:`Capability.EXPLICIT_PREFETCH`), none of which changes a value a user
reads, so the shadow ([Note: the shadow model]) does nothing for them, and the
memory and all-gather checks end at the first:

* ``Unshard``: ``unshard()`` (or ``unshard(async_op=True)`` and ``wait()``) of one
  module, then a forward with gradients, whose outputs must be the shadow's;
* ``Reshard``: ``reshard()`` of one module, at any point, a pending loss included;
* ``ReshardAfterBackward``: ``set_reshard_after_backward`` on the root. A module
  kept unsharded after backward reuses its gathered parameters in the next
  forward (torch documents that they "do not need to be re-all-gathered"), so
  what it computes after an optimizer step or a load changed the shards is not
  defined by the contract (torch and the reference both use the stale ones):
  before a ``Step`` or ``Load`` after such a backward the program does what its
  user must, ``reshard()`` every module;
* ``Prefetch``: explicit forward and backward prefetch lists for every module;
* ``GradSync``: ``set_requires_gradient_sync`` on the root. A backward with it
  off keeps each rank's gradient unreduced; the next backward with it on reduces
  the sum, and so does the shadow, exactly as for ``NoSync`` ([Note: unsynced
  accumulation dtype] in :mod:`conformance.fuzz.shadow`). In between the gradients a user reads
  are not defined by the contract (FSDP2 and the reference show the last reduced
  ones, FSDP1's ``no_sync`` the local sum), and neither is what the optimizer or
  ``zero_grad`` would do with them, so gradients are not compared and ``Step``
  and ``ZeroGrad`` do nothing on either side until a synchronizing backward.
  A program that would end with gradients kept so ends as its user's loop must:
  after its last operation, ``GradSync(on=True)`` and a ``Train``, whose
  synchronizing backward reduces what was kept (else a kept gradient that is
  lost, or reduced twice, would never be compared).

Two controls are settings whose effect the program's checks model instead, each
drawn where the adapter declares it (:attr:`Capability.SET_RESHARD_AFTER_FORWARD`,
:attr:`Capability.GRADIENT_DIVIDE_FACTOR`):

* ``SetReshardAfterForward``: ``set_reshard_after_forward`` on one module (with
  ``recurse``, the modules under it too). No value changes; the units it turns
  off are not gathered again in backward and may stay gathered after a forward
  ([Note: all-gathers in backward], [Note: memory held between iterations]);
* ``GradientDivideFactor``: ``set_gradient_divide_factor`` on one module, whose
  own parameters' gradients are then the sum over ranks divided by the factor
  ([Note: the shadow model]).

``NoSync`` (the adapter's ``no_sync``, defined on the root ``wrap`` returns) does
nothing on a ``fully_shard``-ed model; ``GradSync`` is its counterpart there.

What a user reads is the parameters the optimizer was built with, as
``named_parameters()`` gave them right after sharding (DTensors): their full
values and full gradients (``full_tensor()``), and the model's and optimizer's
own ``state_dict()`` (both kinds of ``Save`` take it, a full one compares its full
values with the shadow's) loaded back with ``load_state_dict``. Which tensors the
module registers while a module is unsharded differs (torch registers the
unsharded ones, the reference keeps the DTensors), so that is not read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor
from torch.utils._pytree import tree_map

from conformance.contract.adapter import Capability, FSDPAdapter
from conformance.contract.optional import (
    activation_checkpoint_wrapper,
    capabilities_of,
    fully_shard,
    reshard,
    set_gradient_divide_factor,
    set_modules_to_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from conformance.fuzz.drawn_precision import mixed_precision_spec
from conformance.fuzz.ops import (
    FullyShardConfig,
    GradientDivideFactor,
    GradSync,
    Op,
    Prefetch,
    Program,
    ProgramConfig,
    Reshard,
    ReshardAfterBackward,
    SetReshardAfterForward,
    Unshard,
)
from conformance.fuzz.twin_checks import unwrapped_names

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["Controls", "fully_shard_features", "fully_shard_requires", "full_params_of", "full_value", "materialize",
           "module_at", "shard_config", "user_buffers"]

#: A capability -> the :data:`~conformance.fuzz.ops.FULLY_SHARD_FEATURES` entry it lets programs draw.
_FEATURE_OF = {Capability.FULLY_SHARD: "fully_shard", Capability.RESHARD_AFTER_FORWARD_INT: "reshard_after_forward_int",
               Capability.FULLY_SHARD_CONTROLS: "fully_shard_controls",
               Capability.EXPLICIT_PREFETCH: "explicit_prefetch", Capability.META_INIT: "meta_init",
               Capability.FULLY_SHARD_MIXED_PRECISION: "fully_shard_mixed_precision",
               Capability.SET_RESHARD_AFTER_FORWARD: "set_reshard_after_forward",
               Capability.GRADIENT_DIVIDE_FACTOR: "gradient_divide_factor"}
#: The modelled controls ([Note: fully_shard programs]) and what each needs.
_SETTINGS = {SetReshardAfterForward: Capability.SET_RESHARD_AFTER_FORWARD,
             GradientDivideFactor: Capability.GRADIENT_DIVIDE_FACTOR}


def fully_shard_features(impl: FSDPAdapter) -> frozenset[str]:
    """What of a ``fully_shard`` program ``impl`` can run (nothing without ``fully_shard``)."""
    if Capability.FULLY_SHARD not in capabilities_of(impl):
        return frozenset()
    return frozenset(feature for cap, feature in _FEATURE_OF.items() if cap in capabilities_of(impl))


def fully_shard_requires(program: Program) -> list[Capability]:
    """The capabilities ``program``'s sharding and operations need."""
    config = program.config
    if not isinstance(config, FullyShardConfig):
        return []
    needs = [Capability.FULLY_SHARD]
    if not isinstance(config.reshard_after_forward, bool):
        needs.append(Capability.RESHARD_AFTER_FORWARD_INT)
    if any(isinstance(op, (Unshard, Reshard, GradSync, ReshardAfterBackward)) for op in program.ops):
        needs.append(Capability.FULLY_SHARD_CONTROLS)
    for kind, capability in _SETTINGS.items():
        if any(isinstance(op, kind) for op in program.ops):
            needs.append(capability)
    if any(isinstance(op, Prefetch) for op in program.ops):
        needs.append(Capability.EXPLICIT_PREFETCH)
    if config.meta_init:
        needs.append(Capability.META_INIT)
    if config.policy is not None:
        needs.append(Capability.FULLY_SHARD_MIXED_PRECISION)
    return needs


def shard_config(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, config: FullyShardConfig) -> nn.Module:
    """Checkpoint the config's blocks, then ``fully_shard`` its paths deepest first (a checkpointed block
    inside its wrapper), then the root, over a 1-D mesh of the world, each ignoring the parameters of the
    config's ignored modules and given the config's policy."""
    mesh = ctx.device_mesh((ctx.world_size,))
    for path in sorted(config.checkpoint, key=lambda p: p.count("."), reverse=True):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, activation_checkpoint_wrapper(impl, getattr(parent, name), offload=False))
    raf = config.reshard_after_forward
    ignored = frozenset(p for path in config.ignored for p in module_at(model, path).parameters())
    policy = mixed_precision_spec(config.policy)
    for path in sorted(config.wrap, key=lambda p: p.count("."), reverse=True):
        fully_shard(impl, module_at(model, path), mesh=mesh, reshard_after_forward=raf, ignored_params=ignored,
                    mixed_precision=policy)
    return fully_shard(impl, model, mesh=mesh, reshard_after_forward=raf, ignored_params=ignored,
                       mixed_precision=policy)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, values: nn.Module, clean: Callable[[str], str]) -> None:
    """``Config.meta_init``: ``model`` (built on the meta device, then sharded) gets storage on ``device``
    (``to_empty``), then every parameter and buffer is filled from ``values`` (the shadow's, unsharded; names
    through ``clean``), a DTensor with this rank's piece of the full tensor."""
    model.to_empty(device=device)
    full = {**dict(values.named_parameters()), **dict(values.named_buffers())}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        value = full[clean(name)].detach()
        if hasattr(tensor, "device_mesh"):
            value = distribute_tensor(value, tensor.device_mesh, tensor.placements,  # type: ignore[attr-defined]
                                       src_data_rank=None)
        tensor.copy_(value)


def module_at(model: nn.Module, path: str) -> nn.Module:
    """The module at ``path`` (``""``: ``model``), looked up by attribute: a checkpoint wrapper passes
    its block's attributes through."""
    module = model
    for part in path.split(".") if path else ():
        module = getattr(module, part)
    return module


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's ``full_tensor()`` (collective), a plain tensor as it is."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().clone()


def full_params_of(impl: FSDPAdapter, model: nn.Module, api: str) -> dict[str, torch.Tensor]:
    """The full values of ``model``'s parameters by the unwrapped model's names (collective): a
    ``fully_shard``-ed model's gathered from its DTensors, a wrapped one's through the adapter."""
    if api == "fully_shard":
        return unwrapped_names({name: full_value(param) for name, param in model.named_parameters()})
    return unwrapped_names(impl.full_params(model))


def user_buffers(model: nn.Module, like: dict[str, torch.Tensor],
                 user_modules: Mapping[nn.Module, str]) -> dict[str, torch.Tensor]:
    """``model``'s buffers, whole, keyed as the unwrapped model names them, in the dtype and on the device of
    ``like``'s buffer of that name: their values are compared, at that dtype's tolerance.

    A buffer is named by the user's module that holds it (``user_modules``: the unwrapped model's
    ``named_modules()``, taken before wrapping; wrapping keeps the user's module objects), so the names
    of the wrappers in between do not matter (a DDP-style ``self.module`` no more than FSDP's
    ``_fsdp_wrapped_module``). A buffer of a module the user never built (an implementation's own) keeps its
    path without the ``_``-prefixed parts, as it did before, and shows up as unexpected."""
    named: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        user = user_modules.get(module)
        for local, buf in module.named_buffers(recurse=False):
            if user is not None:
                name = f"{user}.{local}" if user else local
            else:
                name = ".".join(part for part in f"{path}.{local}".split(".") if part and not part.startswith("_"))
            named[name] = full_value(buf)
    return {name: buf.to(dtype=like[name].dtype, device=like[name].device) if name in like else buf
            for name, buf in named.items()}


def _cloned(tree: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


@dataclass
class Controls:
    """A ``fully_shard``-ed model's parameters as the user holds them and its controls ([Note: fully_shard
    programs]): ``unsynced`` while a backward ran without gradient sync and none with it since, ``kept``
    once a backward ran without resharding after it, until every module is resharded."""

    impl: FSDPAdapter
    model: nn.Module
    params: dict[str, nn.Parameter]
    sync: bool = True
    unsynced: bool = False
    reshards_after_backward: bool = True
    kept: bool = False
    after_forward: dict[str, bool] = field(default_factory=dict)  # units set_reshard_after_forward set
    factors: dict[str, float] = field(default_factory=dict)  # units given a divide factor

    @classmethod
    def of(cls, impl: FSDPAdapter, model: nn.Module, clean: Any) -> Controls:
        return cls(impl, model, clean(dict(model.named_parameters())))

    def units(self, config: ProgramConfig) -> list[nn.Module]:
        """The sharded modules in forward order (the root first)."""
        return [module_at(self.model, unit) for unit in config.units()]

    def unshard(self, op: Unshard) -> None:
        handle = unshard(self.impl, module_at(self.model, op.unit), async_op=op.async_op)
        if handle is not None:
            handle.wait()

    def apply(self, op: Op, config: ProgramConfig) -> None:
        """Run control ``op`` (any but ``Unshard``, which a forward follows)."""
        if isinstance(op, Reshard):
            reshard(self.impl, module_at(self.model, op.unit))
        elif isinstance(op, GradSync):
            set_requires_gradient_sync(self.impl, self.model, op.on)
            self.sync = op.on
        elif isinstance(op, ReshardAfterBackward):
            set_reshard_after_backward(self.impl, self.model, op.on)
            self.reshards_after_backward = op.on
        elif isinstance(op, Prefetch):
            self.prefetch(op, config)
        elif isinstance(op, SetReshardAfterForward):
            set_reshard_after_forward(self.impl, module_at(self.model, op.unit), op.on, recurse=op.recurse)
            under = [unit for unit in config.units() if unit == op.unit or op.recurse and
                     (not op.unit or unit.startswith(op.unit + "."))]
            self.after_forward.update(dict.fromkeys(under, op.on))
        elif isinstance(op, GradientDivideFactor):
            set_gradient_divide_factor(self.impl, module_at(self.model, op.unit), op.factor)
            self.factors[op.unit] = op.factor

    def divisors(self, config: ProgramConfig) -> dict[str, float]:
        """Each parameter of a module given a divide factor -> that factor."""
        return {name: self.factors[unit] for name in self.params if (unit := config.unit_of(name)) in self.factors}

    def before_update(self, config: ProgramConfig) -> None:
        """Before a step or load changes the shards: reshard every module if one may be kept unsharded."""
        if self.kept:
            for module in self.units(config):
                reshard(self.impl, module)
            self.kept = False

    def prefetch(self, op: Prefetch, config: ProgramConfig) -> None:
        """Each module prefetches the next ``op.forward`` in forward order and the next ``op.backward`` in
        backward order (the root first, then the others reversed)."""
        forward = self.units(config)
        backward = forward[:1] + forward[:0:-1]
        for index, module in enumerate(forward):
            set_modules_to_prefetch(self.impl, module, forward=forward[index + 1:index + 1 + op.forward])
        for index, module in enumerate(backward):
            set_modules_to_prefetch(self.impl, module, backward=backward[index + 1:index + 1 + op.backward])

    def after_backward(self) -> None:
        """A backward ran: its gradients (and those kept before) are reduced if sync is on."""
        self.unsynced = not self.sync
        self.kept = self.kept or not self.reshards_after_backward

    def full_params(self) -> dict[str, torch.Tensor]:
        return {name: full_value(param) for name, param in self.params.items()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return {name: None if p.grad is None else full_value(p.grad) for name, p in self.params.items()}

    def save(self, optim: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The model's ``state_dict()`` and the optimizer's (``None``: not saved), cloned."""
        return _cloned(dict(self.model.state_dict())), None if optim is None else _cloned(optim.state_dict())

    def full_optim_state(self, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """A saved optimizer state's per-parameter state, keyed by name, with full values."""
        names = list(self.params)
        return {names[index]: {key: full_value(v) if isinstance(v, torch.Tensor) else v for key, v in entry.items()}
                for index, entry in state["state"].items()}

    def load(self, optim: torch.optim.Optimizer, saved: tuple[dict[str, Any], dict[str, Any] | None]) -> None:
        state, optim_state = saved
        self.model.load_state_dict(_cloned(state))
        if optim_state is not None:
            optim.load_state_dict(_cloned(optim_state))
