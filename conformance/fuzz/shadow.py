"""The stateful fuzzer's oracle: a plain local model that every rank trains on every rank's batches.

[Note: the shadow model]
The shadow is the unwrapped model (same seed, same frozen parameters, no
checkpoint wrapper: recomputation changes no value; a block that checkpoints
itself, [Note: reentrant blocks] in :mod:`conformance.fuzz.drawing`, is
the model's own code and does so here too) with the same optimizer. It
answers every operation of a program ([Note: stateful programs] in
:mod:`conformance.fuzz.ops`) the way data-parallel training on the
ranks must look to a user:

* a forward on rank ``r`` gives the shadow's output on rank ``r``'s batch;
* a backward leaves, in every parameter's gradient, the mean over ranks of the
  gradient of each rank's pending loss (what DDP's averaging gives), added to
  what the gradient held (accumulation);
* a parameter of a ``fully_shard``-ed module given a divide factor
  (``GradientDivideFactor``: torch's ``set_gradient_divide_factor``, that
  module's own parameters only) gets the sum over ranks divided by the factor
  instead of the mean, in the reduce dtype under a policy; the factor in force
  at a synchronizing backward divides what backwards without sync kept too
  (they are reduced there, once);
* a backward without gradient sync (``NoSync``'s first, or one after
  ``GradSync(on=False)``) keeps each rank's gradient unreduced, and the next
  synchronizing backward adds its own gradient to the kept one on each rank
  and reduces the sum once ([Note: unsynced accumulation dtype]);
* step, ``zero_grad``, ``train``/``eval``, saving and loading are the plain
  module's and optimizer's own, and so are clipping the gradients
  (``torch.nn.utils.clip_grad_norm_`` on its reduced gradients: the norm of
  them all as one vector, each scaled by ``max_norm / (total + 1e-6)`` where the
  total exceeds ``max_norm``) and scaling the parameters (``mul_`` on each);
* under a policy with ``keep_low_precision_grads`` the reduced gradients stay
  in the reduction dtype and accumulate in it: torch documents that FSDP then
  "keeps the gradients in the dtype used for gradient reduction" instead of
  upcasting them "in preparation for the optimizer step"
  (``torch.distributed.fsdp.MixedPrecision``); the optimizer steps on them;
* under a policy with a ``buffer_dtype``, floating buffers take that dtype's
  values at the first forward and keep them: torch documents that FSDP "casts
  them to ``buffer_dtype`` in the first forward pass and keeps them in that
  dtype thereafter" and that "for model checkpointing, the buffers are saved in
  full precision" (``torch.distributed.fsdp.MixedPrecision``). So the shadow
  rounds its float32 buffers to the buffer dtype at its first forward and after
  every later load, and saves them in float32.

The shadow keeps no autograd graph: a forward with gradients records which
batch and loss it used, and the backward recomputes them on the same parameters
(no step runs between the two, see the note on programs). Under a
mixed-precision policy each rank's pending losses are computed and
differentiated on a copy of the model in the param dtype and reduced in the
reduce dtype ([Note: fuzz mixed-precision baseline] in
:mod:`conformance.fuzz.drawn_precision`).

[Note: unsynced accumulation dtype]
Under a mixed-precision policy each rank's gradient is computed in the param
dtype, and what a backward without gradient sync keeps is added to by the next
backward before anything is reduced, so the dtype it is kept in shows in the
reduced sum (one rounding of each rank's sum). Each API says which:

* ``wrap`` (``NoSync``, FSDP1's ``no_sync()``): torch documents that inside it
  "gradients will be accumulated in module variables", the parameters backward
  computes with, which are in the param dtype; ``reduce_dtype`` is documented
  as the dtype of the reduction only. So each rank's sum is kept in the param
  dtype, then cast to the reduce dtype and reduced.
* ``fully_shard`` (``GradSync``, ``set_requires_gradient_sync(False)``): torch's
  ``MixedPrecisionPolicy`` documents that with gradient reduction disabled FSDP
  "will accumulate gradients using ``reduce_dtype``"; without one it is the
  param dtype (the reduction's dtype too). A ``fully_shard`` program's policy
  is FSDP2's (``FullyShardConfig``: no ``buffer_dtype`` or ``keep_low_precision_grads``).

Without a policy, and while every reduction is a mean, the shadow adds each
backward's mean at once: summing before or after averaging differs only in the
order of additions in the model's dtype. Otherwise (gradients kept without
sync, a divide factor) it keeps each rank's gradient in the model's dtype as
under a policy and reduces the sum once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from conformance.fuzz.drawn_optimizers import make_optimizer
from conformance.fuzz.drawn_precision import dtype_of, low_precision_model, mixed_precision_spec, model_input
from conformance.fuzz.model import build_model, loss_of, make_batch
from conformance.fuzz.ops import ProgramConfig

__all__ = ["Output", "Shadow", "batch_of", "build", "freeze", "loss_for", "unsynced_dtype"]

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def build(config: ProgramConfig, device: torch.device) -> nn.Module:
    """The config's model, initialised from its seed, with its frozen paths frozen."""
    model = build_model(config.model, config.seed, dtype_of(config.dtype), device)
    freeze(model, config.frozen)
    return model


def freeze(model: nn.Module, paths: tuple[str, ...]) -> None:
    """``requires_grad=False`` for every parameter under each of ``paths``."""
    for path in paths:
        for param in model.get_submodule(path).parameters():
            param.requires_grad_(False)


def batch_of(config: ProgramConfig, batch: int, rank: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s input number ``batch`` (the same on every rank that builds it)."""
    return make_batch(config.model, (config.seed * 16 + batch) * 8 + rank, dtype_of(config.dtype), device)


def unsynced_dtype(config: ProgramConfig) -> torch.dtype:
    """The dtype each rank's unreduced gradient sum is kept in under ``config``'s policy ([Note: unsynced
    accumulation dtype])."""
    spec = mixed_precision_spec(config.policy)
    if spec is None:
        return dtype_of(config.dtype)
    assert spec.param_dtype is not None
    if config.api == "fully_shard" and spec.reduce_dtype is not None:
        return spec.reduce_dtype
    return spec.param_dtype


def loss_for(output: Output, loss: str) -> torch.Tensor:
    """The loss of a :class:`~conformance.fuzz.ops.Forward`: every output (``"all"``) or the
    main one only (``"main"``: an auxiliary output goes unused)."""
    if loss == "main" and isinstance(output, tuple):
        return loss_of(output[0])
    return loss_of(output)


@dataclass
class Shadow:
    """The local model and optimizer standing for what the ranks train ([Note: the shadow model])."""

    config: ProgramConfig
    device: torch.device
    local: nn.Module
    optim: torch.optim.Optimizer
    low: nn.Module | None = None
    pending: list[tuple[int, str]] = field(default_factory=list)
    unsynced: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per rank, kept by backwards without sync
    saved: tuple[dict[str, Any], dict[str, Any] | None] | None = None
    buffers_cast: bool = False  # the first forward happened (see the note on buffers)
    divisors: dict[str, float] = field(default_factory=dict)  # a parameter -> its module's divide factor

    @classmethod
    def of(cls, config: ProgramConfig, device: torch.device) -> Shadow:
        local = build(config, device)
        return cls(config, device, local, make_optimizer(config.optimizer, local.parameters()),
                   low=low_precision_model(local, config.policy))

    def _compute_model(self) -> nn.Module:
        """The module that computes: the model itself, or its low-precision copy refreshed from it."""
        if not self.buffers_cast:
            self.buffers_cast = True
            self._round_buffers()
        if self.low is None:
            return self.local
        with torch.no_grad():
            for low_param, param in zip(self.low.parameters(), self.local.parameters(), strict=True):
                low_param.copy_(param)
            for low_buf, buf in zip(self.low.buffers(), self.local.buffers(), strict=True):
                low_buf.copy_(buf)
        return self.low

    def _round_buffers(self) -> None:
        """Floating buffers to the policy's buffer dtype's values, kept in their own dtype (see the note)."""
        spec = mixed_precision_spec(self.config.policy)
        if spec is None or spec.buffer_dtype is None:
            return
        with torch.no_grad():
            for buf in self.local.buffers():
                if buf.is_floating_point():
                    buf.copy_(buf.to(spec.buffer_dtype))

    def _input(self, batch: int, rank: int) -> torch.Tensor:
        return model_input(batch_of(self.config, batch, rank, self.device), self.config.policy)

    def forward(self, batch: int, rank: int, *, grad: bool, loss: str) -> tuple[Output, torch.Tensor]:
        """Rank ``rank``'s output and loss for ``batch``; with ``grad`` the loss becomes pending."""
        with torch.no_grad():
            output = self._compute_model()(self._input(batch, rank))
            value = loss_for(output, loss)
        if grad:
            self.pending.append((batch, loss))
        return output, value

    def divide(self, names: list[str], factor: float) -> None:
        """Reduce the gradients of the parameters ``names`` to their sum over ranks divided by ``factor``."""
        self.divisors.update(dict.fromkeys(names, factor))

    def backward(self, *, sync: bool = True) -> bool:
        """Add the mean over ranks of the pending losses' gradients (or their sum over a divide factor; without
        ``sync``: keep each rank's gradient for the next synchronizing backward); ``False`` if nothing was pending."""
        if not self.pending:
            return False
        model, world = self._compute_model(), self.config.world_size
        if self.low is None and sync and not self.unsynced and not self.divisors:  # a mean, at once (the note)
            for rank in range(world):
                (self._total(model, rank) / world).backward()
        else:
            self._accumulate([self._rank_grads(model, rank) for rank in range(world)], sync)
        self.pending.clear()
        return True

    def _total(self, model: nn.Module, rank: int) -> torch.Tensor:
        total, *more = [loss_for(model(self._input(batch, rank)), kind) for batch, kind in self.pending]
        for loss in more:
            total = total + loss
        return total

    def _rank_grads(self, model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s gradients of the pending losses alone; the gradients ``model`` held stay."""
        held = {name: param.grad for name, param in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        self._total(model, rank).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if model is self.local:  # the low-precision copy holds nothing of its own
            for name, param in model.named_parameters():
                param.grad = held[name]
        return grads

    def _accumulate(self, per_rank: list[dict[str, torch.Tensor]], sync: bool) -> None:
        """Add each rank's gradients to what it kept, in the kept dtype; reduce the sums if ``sync``."""
        kept = self.unsynced or [{} for _ in per_rank]
        dtype = unsynced_dtype(self.config)
        for grads, new in zip(kept, per_rank, strict=True):
            for name, grad in new.items():
                grads[name] = grads[name].add_(grad) if name in grads else grad.to(dtype)
        self.unsynced = [] if sync else kept
        if sync:
            self._add_reduced(kept)

    def _add_reduced(self, per_rank: list[dict[str, torch.Tensor]]) -> None:
        """Each gradient's sum over ranks in the reduce dtype, over the world size or its divide factor, added."""
        spec = mixed_precision_spec(self.config.policy)
        dtype = unsynced_dtype(self.config) if spec is None else spec.reduce_dtype or spec.param_dtype
        keep_low = spec is not None and spec.keep_low_precision_grads
        for name, param in self.local.named_parameters():
            if name not in per_rank[0]:
                continue
            summed = torch.stack([grads[name].to(dtype) for grads in per_rank]).sum(0)
            reduced = summed / self.divisors.get(name, self.config.world_size)
            grad = reduced if keep_low else reduced.to(param.dtype)
            if param.grad is not None:
                param.grad.add_(grad)
            elif grad.dtype == param.dtype:
                param.grad = grad
            else:  # autograd rejects assigning a gradient in another dtype; its data may be one
                param.grad = torch.empty(grad.shape, dtype=param.dtype, device=grad.device)
                param.grad.data = grad

    def step(self) -> bool:
        """The optimizer step; ``False`` (skipped) while a loss is pending."""
        if self.pending:
            return False
        self.optim.step()
        return True

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the reduced gradients: their total norm, each scaled by
        ``max_norm / (total + 1e-6)`` where the total exceeds ``max_norm``."""
        return torch.nn.utils.clip_grad_norm_(self.local.parameters(), max_norm, norm_type=norm_type)

    def scale_params(self, scale: float) -> None:
        """Every parameter multiplied by ``scale`` in place."""
        with torch.no_grad():
            for param in self.local.parameters():
                param.mul_(scale)

    def save(self, optim: bool) -> None:
        self.saved = (copy.deepcopy(self.local.state_dict()), copy.deepcopy(self.optim.state_dict()) if optim else None)

    def load(self) -> bool:
        """Load the last save, abandoning a pending loss; ``False`` if nothing was saved."""
        if self.saved is None:
            return False
        self.pending.clear()
        model_state, optim_state = self.saved
        self.local.load_state_dict(copy.deepcopy(model_state))
        if self.buffers_cast:
            self._round_buffers()
        if optim_state is not None:
            self.optim.load_state_dict(copy.deepcopy(optim_state))
        return True

    def optim_state_by_name(self) -> dict[str, dict[str, Any]]:
        """The optimizer's per-parameter state keyed by parameter name (the order the optimizer got them)."""
        names = [name for name, _ in self.local.named_parameters()]
        state = self.optim.state_dict()["state"]
        return {names[index]: value for index, value in state.items()}
