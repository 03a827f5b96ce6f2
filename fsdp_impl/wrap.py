"""Auto-wrap policies (same call signature as ``torch.distributed.fsdp.wrap``) and the wrapper.

A policy is a callable ``policy(module, recurse, nonwrapped_numel) -> bool``:
with ``recurse=True`` it answers "look inside ``module``?", with
``recurse=False`` "make ``module`` its own unit?". Wrapping is post-order, so
nested units are built before their parents and each unit flattens only what
its descendants did not take.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

from fsdp_impl.unit_state import is_unit

__all__ = [
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "auto_wrap",
]

Policy = Callable[..., bool]


def always_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, **kwargs: Any
) -> bool:
    """Every submodule becomes a unit."""
    return True


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int = 0,
    transformer_layer_cls: Iterable[type[nn.Module]] = (),
) -> bool:
    """Instances of ``transformer_layer_cls`` become units (bind it with ``functools.partial``)."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, min_num_params: int = int(1e8)
) -> bool:
    """Modules whose not-yet-wrapped parameters reach ``min_num_params`` become units."""
    return True if recurse else nonwrapped_numel >= min_num_params


class ModuleWrapPolicy:
    """Every instance of one of ``module_classes`` becomes a unit."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = tuple(dict.fromkeys(module_classes))
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"ModuleWrapPolicy expects nn.Module subclasses, got {cls!r}")
        self._module_classes = classes

    def __call__(
        self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, **kwargs: Any
    ) -> bool:
        return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[cls.__name__ for cls in self._module_classes]})"


def check_policy(policy: Any) -> Policy:
    """``policy`` if it is usable as an auto-wrap policy, else a TypeError naming it."""
    if isinstance(policy, ModuleWrapPolicy) or callable(policy):
        return policy
    raise TypeError(f"auto_wrap_policy must be a ModuleWrapPolicy or a callable, got {policy!r}")


def auto_wrap(
    root: nn.Module,
    policy: Any,
    ignored: set[nn.Module],
    make_unit: Callable[[nn.Module], nn.Module],
) -> None:
    """Replace, in post-order, every strict descendant of ``root`` the policy selects."""
    policy = check_policy(policy)
    _wrap_children(root, policy, ignored, make_unit)


def _is_container(module: nn.Module) -> bool:
    # ModuleList/ModuleDict have no forward: their children are what runs.
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _wrap_children(
    module: nn.Module,
    policy: Policy,
    ignored: set[nn.Module],
    make_unit: Callable[[nn.Module], nn.Module],
) -> int:
    """Wrap selected descendants of ``module``; return the numel left unwrapped below it."""
    remaining = sum(p.numel() for p in module.parameters(recurse=False))
    for name, child in list(module._modules.items()):
        if child is None or child in ignored or is_unit(child):
            continue
        if not policy(module=child, recurse=True, nonwrapped_numel=_numel(child, ignored)):
            remaining += _numel(child, ignored)
            continue
        child_remaining = _wrap_children(child, policy, ignored, make_unit)
        if not _is_container(child) and policy(
            module=child, recurse=False, nonwrapped_numel=child_remaining
        ):
            module._modules[name] = make_unit(child)
        else:
            remaining += child_remaining
    return remaining


def _numel(module: nn.Module, ignored: set[nn.Module]) -> int:
    """Parameters under ``module`` not already owned by a unit or ignored."""
    total, stack = 0, [module]
    while stack:
        sub = stack.pop()
        if sub in ignored or is_unit(sub):
            continue
        total += sum(p.numel() for p in sub.parameters(recurse=False))
        stack.extend(child for child in sub.children())
    return total
