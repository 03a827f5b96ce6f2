"""The optimizers the fuzzers train with; a wrapped model's through its adapter
(:func:`conformance.contract.optional.optimizer`), a baseline's directly.

[Note: drawn optimizers]
Both fuzzers draw one of two families (:data:`conformance.fuzz.example.OPTIMIZERS`): ``"sgd"``, SGD with
momentum, whose steps are in proportion to the gradient (so a missing or doubled divide shows), and
``"adam"``, whose steps are normalised by the gradient's running scale. A stateful program's ``"adam"``
draw stands for the normalising optimizers, whose per-parameter state is what the state-dict paths carry:
which one is read off bits 1 and 2 of the program's seed (drawn either way; [Note: options from an unused
draw] in :mod:`conformance.fuzz.drawing`), so the programs of every seed are otherwise the same:

* ``"adam"``: Adam (two moments, a step count created at the first step);
* ``"amsgrad"``: Adam with ``amsgrad=True`` (a third state, the running maximum of the second moment);
* ``"rmsprop"``: centred RMSprop with momentum (three states: ``square_avg``, ``grad_avg``,
  ``momentum_buffer``, and a step count);
* ``"adagrad"``: Adagrad, whose state (``sum``, ``step``) exists from its construction for every
  parameter, before any step: a state dict saved before the first step carries it.

None uses weight decay: a flat parameter steps the unused parameters it holds with zero gradients (what a
local model leaves without a gradient, and so unstepped), which is harmless only while a zero gradient
moves nothing ([Note: stateful invariant] in :mod:`conformance.fuzz.stateful`).
"""

from __future__ import annotations

from typing import Any

import torch

from conformance.contract import optional

__all__ = ["ADAM_EPS", "COPIES", "STATEFUL_OPTIMIZERS", "make_optimizer", "stateful_optimizer", "wrapped_optimizer"]

#: Every optimizer a program may train with (the note), and a parameter's copies in its state (the step count
#: aside): what a rank's optimizer may hold ([Note: memory held between iterations] in :mod:`conformance.fuzz.held`).
COPIES = {"sgd": 1, "adam": 2, "amsgrad": 3, "rmsprop": 3, "adagrad": 1}
STATEFUL_OPTIMIZERS = tuple(COPIES)
#: What bits 1 and 2 of a stateful program's seed make of an ``"adam"`` draw (the note): every optimizer but SGD.
_NORMALISING = tuple(kind for kind in STATEFUL_OPTIMIZERS if kind != "sgd")
#: The ``eps`` of every normalising optimizer. With torch's 1e-8 (Adagrad's 1e-10) a gradient at
#: rounding-noise level (1e-9: a LayerNorm over two features passes back exactly zero in theory, and what
#: flows through it is rounding) takes a step of a tenth of the learning rate, so two correct implementations
#: rounding differently end 2e-5 apart (the reference, torch FSDP1 and FSDP2 alike, at four ranks); at 1e-3
#: such noise moves a parameter by 1e-8, while real gradients (1e-2 and up) still take normalised steps.
ADAM_EPS = 1e-3


def stateful_optimizer(drawn: str, seed: int) -> str:
    """The optimizer a stateful program trains with, from the family ``drawn`` and the program's ``seed``
    (the note)."""
    if drawn == "sgd":
        return drawn
    if drawn != "adam":
        raise ValueError(f"unknown optimizer family {drawn!r}; expected 'sgd' or 'adam'")
    return _NORMALISING[(seed >> 1) % len(_NORMALISING)]


#: Each optimizer's class and arguments (the note).
_ARGS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "eps": ADAM_EPS}),
    "amsgrad": (torch.optim.Adam, {"lr": 0.01, "eps": ADAM_EPS, "amsgrad": True}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "eps": ADAM_EPS, "momentum": 0.9, "centered": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.01, "eps": ADAM_EPS}),
}


def _optim_args(kind: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if kind not in _ARGS:
        raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {STATEFUL_OPTIMIZERS}")
    return _ARGS[kind]


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """The optimizer ``kind`` (of :data:`STATEFUL_OPTIMIZERS`) names, over a baseline's ``params``."""
    cls, kwargs = _optim_args(kind)
    return cls(params, **kwargs)


def wrapped_optimizer(impl: Any, model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    """The optimizer ``kind`` names for ``model``, sharded by ``impl``."""
    cls, kwargs = _optim_args(kind)
    return optional.optimizer(impl, model, cls, **kwargs)
