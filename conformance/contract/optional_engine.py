"""Optional adapter methods an implementation built as one engine needs (DeepSpeed's ZeRO): its own way of
releasing a model, a step that zeroes gradients, and strategies without a unit per module.

They are part of :mod:`conformance.contract.optional`, which re-exports them: cases and fuzzers reach them as
``optional.release``, ``optional.step_zeroes_grads`` and ``optional.units_per_module``, and that module's table
lists their defaults.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["release", "step_zeroes_grads", "units_per_module"]


def release(adapter: Any, model: nn.Module) -> None:
    """What a user of the implementation does before dropping ``model`` (the root :meth:`wrap` returned) for good.

    Optional part of the contract: an adapter whose implementation documents a call that releases a wrapped
    model (DeepSpeed's ``engine.destroy()``) defines ``release(model)``; the default does nothing, since
    dropping the last reference frees a torch FSDP model. Collective: every rank calls it. A row that checks
    a dropped model is freed calls it first, so the row holds the implementation to its own way of letting go.
    """
    method = getattr(adapter, "release", None)
    if method is not None:
        method(model)


def step_zeroes_grads(adapter: Any) -> bool:
    """Whether the adapter's step (``optional.step``) ends with a ``zero_grad(set_to_none=True)`` of its own.

    Optional part of the contract: an adapter whose implementation's step clears the gradients it
    applied (DeepSpeed's ``engine.step()`` calls its ZeRO optimizer's ``zero_grad``, so a DeepSpeed loop has
    none) sets ``step_zeroes_grads = True``; the default is ``False``, a torch step, after which gradients
    accumulate into the next backward until the user zeroes them. A fuzzer's shadow model zeroes its own
    gradients after such a step, so a program of steps without a ``ZeroGrad`` between them compares like
    with like.
    """
    return bool(getattr(adapter, "step_zeroes_grads", False))


def units_per_module(adapter: Any, strategy: str | None) -> bool:
    """Whether wrapping with ``strategy`` (``None``: the default) and an auto-wrap policy makes a unit of each
    module the policy names, as :meth:`FSDPAdapter.units` reports them.

    Optional part of the contract: an implementation whose sharding is a property of the whole model under
    some strategies, with no per-module unit to report (DeepSpeed's ZeRO stages 1 and 2: one engine, its
    parameters whole on every rank), defines ``units_per_module(strategy) -> bool``; the default is ``True``.
    A row that asks about the unit of a module the policy names is ``n/a`` where this is ``False``.
    """
    method = getattr(adapter, "units_per_module", None)
    return True if method is None else bool(method(strategy))
