"""The optimizers the fuzzers train with: SGD with momentum, or Adam with a raised ``eps``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ADAM_EPS", "make_optimizer"]

_LR = {"sgd": 0.05, "adam": 0.01}
#: Adam's ``eps``. With torch's 1e-8 a gradient at rounding-noise level (1e-9: a LayerNorm over two
#: features passes back exactly zero in theory, and what flows through it is rounding) takes a step of
#: a tenth of the learning rate, so two correct implementations rounding differently end 2e-5 apart
#: (the reference, torch FSDP1 and FSDP2 alike, at four ranks); at 1e-3 such noise moves a parameter
#: by 1e-8, while real gradients (1e-2 and up) still take Adam's normalised steps.
ADAM_EPS = 1e-3


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """The optimizer ``kind`` (``"sgd"`` or ``"adam"``) names, over ``params``."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=_LR[kind], momentum=0.9)
    return torch.optim.Adam(params, lr=_LR[kind], eps=ADAM_EPS)
