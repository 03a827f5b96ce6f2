"""The parity fuzzer: one drawn example trained on the harness's ranks against a local baseline.

The baseline is the unwrapped model on every rank, fed every rank's batches:
rank ``r``'s loss is compared with the baseline's loss on rank ``r``'s batch,
and the baseline's gradient is the mean over ranks of those losses'
gradients, which is what data-parallel averaging produces. Under a
mixed-precision policy the baseline trains as [Note: fuzz mixed-precision
baseline] in :mod:`conformance.fuzz.drawn_precision` says, and every output must come
out in the param dtype. Comparisons are ``torch.testing.assert_close`` with its
defaults for the dtype (through :mod:`fixtures.parity`; under a policy, losses
and gradients in the param dtype, as that note explains). A missing gradient
(``None``) and an all-zero one are treated alike, as :mod:`conformance.fuzz.twin_checks`
says. A mismatch is kept and the step goes on; the ranks' verdicts agree as
[Note: fuzz verdicts agree across ranks] says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from conformance.contract import optional
from conformance.contract.adapter import AutoWrap, FSDPAdapter, WrapSpec
from conformance.contract.case import not_applicable
from conformance.contract.optional import full_grads
from conformance.fuzz.agreement import agree, attempt
from conformance.fuzz.drawn_optimizers import make_optimizer, wrapped_optimizer
from conformance.fuzz.drawn_precision import (
    as_compared,
    dtype_of,
    in_compute_dtype,
    local_backward,
    low_precision_model,
    mixed_precision_spec,
    model_input,
)
from conformance.fuzz.example import Example
from conformance.fuzz.model import build_model, loss_of, make_batch
from conformance.fuzz.twin_checks import assert_dtypes, zeros_for_none
from fixtures.parity import assert_close_named, named_grads

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["check_example", "run_example", "wrap_plan"]


def wrap_plan(impl: FSDPAdapter, model: nn.Module, example: Example) -> nn.Module:
    """Wrap the root, each path of ``example.wrap`` a unit of its own under it (a plan the adapter realises)."""
    units = AutoWrap(kind="module_names", module_names=example.wrap) if example.wrap else None
    return impl.wrap(model, WrapSpec(strategy=example.strategy, use_orig_params=example.use_orig_params,
                                     mixed_precision=mixed_precision_spec(example.policy), auto_wrap=units))


def _batch_seed(example: Example, step: int, micro: int, rank: int) -> int:
    return ((example.seed * 8 + step) * 8 + micro) * 8 + rank


@dataclass
class _Run:
    """One example's two models on this rank."""

    example: Example
    impl: FSDPAdapter
    rank: int
    device: torch.device
    model: nn.Module
    local: nn.Module
    optim: torch.optim.Optimizer
    local_optim: torch.optim.Optimizer
    low: nn.Module | None = None  # the baseline's low-precision copy under a policy
    mismatch: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return dtype_of(self.example.dtype)

    def compare(self, label: str, check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """``check(*args, **kwargs)``; keep the first mismatch (the step goes on: [Note: fuzz verdicts agree
        across ranks])."""
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            if self.mismatch is None:
                lines = str(exc).strip().splitlines()
                self.mismatch = f"{label}: {' | '.join(lines[:6])}"

    def step(self, step: int) -> None:
        """One optimizer step: micro-batches, grads, the update, params."""
        self.forward_backward(step)
        if self.example.use_orig_params:  # the original parameters stay registered on the module
            self.compare("parameters registered after backward", _assert_same_count,
                         list(self.model.parameters()), list(self.local.parameters()))
        grads = full_grads(self.impl, self.model)  # None: not exposed for this wrap; params still compared
        if grads is not None:
            want, policy = named_grads(self.local), self.example.policy
            self.compare("grads after backward", assert_close_named, in_compute_dtype(zeros_for_none(grads, want),
                         policy), in_compute_dtype(zeros_for_none(want, grads), policy), what="grads")
        optional.step(self.impl, self.model, self.optim)
        self.local_optim.step()
        for optim in (self.optim, self.local_optim):
            optim.zero_grad(set_to_none=self.example.set_to_none)
        got = self.impl.full_params(self.model)
        want_params = {name: p.detach() for name, p in self.local.named_parameters()}
        self.compare("params after step", assert_close_named, got, want_params, what="params")

    def forward_backward(self, step: int) -> None:
        """Every micro-batch: this rank's loss on the wrapped model, every rank's on the baseline."""
        ex = self.example
        for micro in range(ex.micro_batches):
            batches = [
                make_batch(ex.model, _batch_seed(ex, step, micro, r), self.dtype, self.device)
                for r in range(ex.world_size)
            ]
            output = self.model(model_input(batches[self.rank], ex.policy))
            if ex.policy is not None:
                self.compare(f"output dtype of micro-batch {micro}", assert_dtypes, output, ex.policy.param_dtype)
            loss = loss_of(output)
            loss.backward()
            want = self.local_backward(batches)[self.rank]
            self.compare(f"loss of micro-batch {micro}", torch.testing.assert_close,
                         as_compared(loss.detach(), ex.policy), as_compared(want, ex.policy))

    def local_backward(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The baseline's backward of every rank's batch; each rank's loss."""
        if self.example.policy is not None:
            assert self.low is not None
            return local_backward(self.local, self.low, batches, self.example.policy)
        local_losses = [loss_of(self.local(batch)) for batch in batches]
        (sum(local_losses) / self.example.world_size).backward()  # type: ignore[union-attr]
        return [loss.detach() for loss in local_losses]


def _assert_same_count(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    if len(got) != len(want):
        raise AssertionError(f"the wrapped model has {len(got)} parameters, the local model {len(want)}")


def _setup(ctx: RankContext, impl: FSDPAdapter, example: Example) -> _Run:
    dtype = dtype_of(example.dtype)
    local = build_model(example.model, example.seed, dtype, ctx.device)
    model = wrap_plan(impl, build_model(example.model, example.seed, dtype, ctx.device), example)
    return _Run(
        example=example,
        impl=impl,
        rank=ctx.rank,
        device=ctx.device,
        model=model,
        local=local,
        optim=wrapped_optimizer(impl, model, example.optimizer),
        local_optim=make_optimizer(example.optimizer, local.parameters()),
        low=low_precision_model(local, example.policy),
    )


def check_example(ctx: RankContext, impl: FSDPAdapter, example: Example) -> str | None:
    """Train ``example`` on ``impl`` and on the baseline; the first failure (same on every rank) or ``None``."""
    if example.world_size != ctx.world_size:
        raise ValueError(f"example is for world_size {example.world_size}, running on {ctx.world_size} ranks")
    run, failure = attempt("wrap", _setup, ctx, impl, example)
    failure = agree(ctx, failure)
    if failure is not None:
        return failure
    for step in range(example.steps):
        raised = attempt("raised", run.step, step)[1]
        failure = agree(ctx, raised or run.mismatch)
        if failure is not None:
            return f"step {step}, {failure}"
    return None


def run_example(ctx: RankContext, impl: FSDPAdapter, example: Example) -> None:
    """A reproducer's body: fail with the first mismatch of ``example`` on every rank (``n/a`` where the
    adapter's ``param_dtypes`` leaves out the example's dtype)."""
    if not optional.takes_param_dtype(impl, dtype_of(example.dtype)):
        not_applicable(f"{impl.name} takes no {example.dtype} parameters (its param_dtypes)")
    failure = check_example(ctx, impl, example)
    if failure is not None:
        raise AssertionError(f"{impl.name} differs from the local baseline: {failure}")
