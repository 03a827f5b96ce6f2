"""grad_clip: ``torch.nn.utils.clip_grad_norm_`` over a sharded model's gradients.

- ``clip_grad_norm[norm_type=1|2]``: :class:`fixtures.blocks.Blocks`, every block and the root
  ``fully_shard``-ed, and a local copy given the mean of every rank's loss; each of three steps
  clips to a norm small enough that every step is clipped. The total norm ``clip_grad_norm_``
  returns (a DTensor's ``full_tensor()``, or a plain tensor) equals the local model's on every
  rank, and after the SGD steps the parameters equal the local model's: the norm spans every
  rank's shards, and the clipping scaled the gradients the optimizer reads. (The infinity norm is
  left out: torch's ``_foreach_norm`` refuses it on an empty tensor, and a rank whose piece of a
  parameter with fewer rows than ranks is empty gets one, whatever the implementation.)
- ``wrapper_clip_grad_norm[strategy=...,norm_type=...,use_orig_params=...]``: FSDP1's own
  ``clip_grad_norm_`` on the root of :class:`fixtures.blocks.Blocks` wrapped with a unit per block. Its
  docstring (torch 2.13): the norm "is computed over all parameters' gradients as viewed as a single vector,
  and the gradients are modified in-place", for sharded strategies too ("this method handles the fact that
  gradients are sharded across ranks"). Each of two steps clips a local copy's gradients (the mean of every
  rank's loss) with ``torch.nn.utils.clip_grad_norm_``: the total norm returned on every rank equals the
  local model's, and after the SGD steps the parameters equal the local model's. The infinity norm runs
  with flat parameters only: a rank's piece of a parameter can be empty with ``use_orig_params``, which
  the infinity norm refuses (above).
- ``wrapper_clip_grad_norm_float64``: the same on a float64 model, ``FULL_SHARD``, the 2-norm. The docstring:
  "The total norm returned will have the 'largest' dtype across all parameters/gradients as defined by
  PyTorch's type promotion semantics", so the norm is float64, equal to the local model's in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, Capability, FSDPAdapter, WrapSpec
from conformance.contract.case import TWO_OR_MORE, case
from fixtures.blocks import Blocks, block_batch
from fixtures.parity import assert_close_named
from fixtures.sharded_blocks import LR, full_of, mesh_over, shard_blocks

if TYPE_CHECKING:
    from harness import RankContext

MAX_NORM = 0.05


@case("grad_clip/clip_grad_norm", clause="C19", world_size=TWO_OR_MORE, requires=[Capability.FULLY_SHARD])
@pytest.mark.parametrize("norm_type", ["1", "2"])
def test_clip_grad_norm(ctx: RankContext, impl: FSDPAdapter, norm_type: str) -> None:
    """``clip_grad_norm_`` over the sharded gradients returns the local model's total norm on every rank,
    and after three clipped SGD steps the parameters equal the local model's."""
    model = shard_blocks(impl, Blocks(seed=0).to(ctx.device), mesh_over(ctx))
    kind = float(norm_type)

    def clip() -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=kind)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    local = _clipped_steps(ctx, impl, model, 3, kind, clip)
    assert_close_named(full_of(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


def _clipped_steps(ctx: RankContext, impl: FSDPAdapter, model: nn.Module, steps: int, kind: float,
                   clip: Callable[[], torch.Tensor], dtype: torch.dtype = torch.float32) -> nn.Module:
    """``steps`` SGD steps of the sharded ``model`` (its gradients clipped by ``clip``, which returns the total
    norm) beside a local Blocks given the mean of every rank's loss and clipped by torch: every step is clipped,
    and the total norm is the local model's on every rank, in its dtype. ``dtype`` is the models' (inputs are
    cast to it). Returns the local model, for the caller's final comparison of parameters."""
    local = Blocks(seed=0).to(ctx.device, dtype)
    optim = optional.optimizer(impl, model, torch.optim.SGD, lr=LR)
    local_optim = torch.optim.SGD(local.parameters(), lr=LR)
    for step in range(steps):
        optim.zero_grad(set_to_none=True)
        local_optim.zero_grad(set_to_none=True)
        model(block_batch(step, ctx.rank, ctx.device).to(dtype)).sum().backward()
        losses = [local(block_batch(step, rank, ctx.device).to(dtype)).sum() for rank in range(ctx.world_size)]
        (torch.stack(losses).sum() / ctx.world_size).backward()
        norm = clip()
        local_norm = torch.nn.utils.clip_grad_norm_(local.parameters(), MAX_NORM, norm_type=kind)
        assert local_norm > MAX_NORM, f"step {step}: the local norm {local_norm} is not clipped; lower MAX_NORM"
        label = f"rank {ctx.rank} step {step}: total norm"
        torch.testing.assert_close(norm.to(local_norm.device), local_norm, msg=lambda m, label=label: f"{label}: {m}")
        optional.step(impl, model, optim)
        local_optim.step()
    return local


WRAPPER_CLIPS = [("FULL_SHARD", "2", False), ("FULL_SHARD", "inf", False), ("NO_SHARD", "2", False),
                 ("FULL_SHARD", "1", True)]


@case("grad_clip/wrapper_clip_grad_norm", clause="C19", world_size=TWO_OR_MORE,
      requires=[Capability.WRAPPER_METHODS])
@pytest.mark.parametrize(("strategy", "norm_type", "use_orig_params"), WRAPPER_CLIPS)
def test_wrapper_clip_grad_norm(ctx: RankContext, impl: FSDPAdapter, strategy: str, norm_type: str,
                                use_orig_params: bool) -> None:
    """The wrapper's own ``clip_grad_norm_`` returns the local model's total norm on every rank, and after
    two clipped SGD steps the parameters equal the local model's."""
    plain = Blocks(seed=0).to(ctx.device)
    spec = WrapSpec(strategy=strategy, use_orig_params=use_orig_params,
                    auto_wrap=AutoWrap.submodules(plain, plain.blocks()))
    model = impl.wrap(plain, spec)
    kind = float(norm_type)
    local = _clipped_steps(ctx, impl, model, 2, kind, lambda: optional.clip_grad_norm(impl, model, MAX_NORM, kind))
    assert_close_named(impl.full_params(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")


@case("grad_clip/wrapper_clip_grad_norm_float64", clause="C19", world_size=TWO_OR_MORE,
      requires=[Capability.WRAPPER_METHODS])
def test_wrapper_clip_grad_norm_float64(ctx: RankContext, impl: FSDPAdapter) -> None:
    """On a float64 model sharded with ``FULL_SHARD``, the wrapper's own ``clip_grad_norm_`` returns the local
    model's total norm, as a float64 tensor, on every rank, and after two clipped SGD steps the parameters
    equal the local model's."""
    plain = Blocks(seed=0).to(ctx.device, torch.float64)
    model = impl.wrap(plain, WrapSpec(strategy="FULL_SHARD", auto_wrap=AutoWrap.submodules(plain, plain.blocks())))
    local = _clipped_steps(ctx, impl, model, 2, 2.0, lambda: optional.clip_grad_norm(impl, model, MAX_NORM, 2.0),
                           torch.float64)
    assert_close_named(impl.full_params(model), dict(local.named_parameters()), what=f"rank {ctx.rank}: parameters")
