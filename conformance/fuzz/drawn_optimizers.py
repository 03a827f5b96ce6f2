"""The optimizers the fuzzers train with: SGD with momentum, or Adam with a raised ``eps``; a wrapped model's
through its adapter (:func:`conformance.contract.optional.optimizer`), a baseline's directly."""

from __future__ import annotations

from typing import Any

import torch

from conformance.contract import optional

__all__ = ["ADAM_EPS", "make_optimizer", "wrapped_optimizer"]

_LR = {"sgd": 0.05, "adam": 0.01}
#: Adam's ``eps``. With torch's 1e-8 a gradient at rounding-noise level (1e-9: a LayerNorm over two
#: features passes back exactly zero in theory, and what flows through it is rounding) takes a step of
#: a tenth of the learning rate, so two correct implementations rounding differently end 2e-5 apart
#: (the reference, torch FSDP1 and FSDP2 alike, at four ranks); at 1e-3 such noise moves a parameter
#: by 1e-8, while real gradients (1e-2 and up) still take Adam's normalised steps.
ADAM_EPS = 1e-3


def _optim_args(kind: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if kind == "sgd":
        return torch.optim.SGD, {"lr": _LR[kind], "momentum": 0.9}
    if kind == "adam":
        return torch.optim.Adam, {"lr": _LR[kind], "eps": ADAM_EPS}
    raise ValueError(f"unknown optimizer kind {kind!r}; expected 'sgd' or 'adam'")


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """The optimizer ``kind`` (``"sgd"`` or ``"adam"``) names, over a baseline's ``params``."""
    cls, kwargs = _optim_args(kind)
    return cls(params, **kwargs)


def wrapped_optimizer(impl: Any, model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    """The optimizer ``kind`` names for ``model``, sharded by ``impl``."""
    cls, kwargs = _optim_args(kind)
    return optional.optimizer(impl, model, cls, **kwargs)
