"""Wrap plans: which submodules of a wrapped module become units of their own.

A case describes nesting to :meth:`~conformance.contract.adapter.FSDPAdapter.wrap`
as a plan, :class:`AutoWrap` in ``WrapSpec.auto_wrap``, and each adapter realises
it its own way: an auto-wrap policy given to one root call, nested calls
bottom-up, per-parameter groups. A case that instead calls ``wrap`` on a
submodule and then on a module holding it tests FSDP1's manual nesting itself
and declares :attr:`~conformance.contract.adapter.Capability.MANUAL_NESTING`
([Note: manual nesting is declared] in :mod:`conformance.contract.declared`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.nn as nn

__all__ = ["AutoWrap", "WRAP_KINDS"]

#: :attr:`AutoWrap.kind`'s values.
WRAP_KINDS = ("module_classes", "transformer", "always", "module_names")


@dataclass(frozen=True)
class AutoWrap:
    """Which submodules become their own unit.

    ``module_classes``: every instance of these classes (ModuleWrapPolicy).
    ``transformer``: the same set, but through ``transformer_auto_wrap_policy``
    (a callable policy), to check implementations accept both forms.
    ``always``: every submodule (``always_wrap_policy``).
    ``module_names``: the submodules ``module_names`` names, as ``named_modules()`` of the
    module given to ``wrap`` spells them (:meth:`submodules` builds such a plan).
    A unit nested in another keeps the parameters it owns; the root owns the rest.
    """

    module_classes: tuple[type[nn.Module], ...] = ()
    kind: str = "module_classes"
    module_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in WRAP_KINDS:
            raise ValueError(f"AutoWrap.kind must be one of {'|'.join(WRAP_KINDS)}, got {self.kind!r}")
        by_name = self.kind == "module_names"
        if by_name and self.module_classes:
            raise ValueError(f"AutoWrap(kind='module_names') takes no module classes, got {self.module_classes!r}")
        if not by_name and self.module_names:
            raise ValueError(f"AutoWrap(kind={self.kind!r}) takes no module names, got {self.module_names!r}")
        if self.kind in ("module_classes", "transformer") and not self.module_classes:
            raise ValueError(f"AutoWrap(kind={self.kind!r}) needs at least one module class")
        if by_name:
            _check_names(self.module_names)

    @classmethod
    def submodules(cls, root: nn.Module, modules: Iterable[nn.Module]) -> AutoWrap:
        """The plan that makes each of ``modules`` (strict submodules of ``root``) a unit, by name."""
        names = {id(module): name for name, module in root.named_modules() if name}
        chosen = list(modules)
        outside = [type(module).__name__ for module in chosen if id(module) not in names]
        if outside:
            raise ValueError(f"AutoWrap.submodules: {outside} are not submodules of the {type(root).__name__}")
        return cls(kind="module_names", module_names=tuple(names[id(module)] for module in chosen))

    def units_under(self, root: nn.Module, ignored: Iterable[nn.Module] = ()) -> list[nn.Module]:
        """The strict submodules of ``root`` this plan makes units, in ``root.modules()`` order, none in or under
        an ignored module; a name ``root`` has no submodule for is a ValueError naming it."""
        skip = {id(module) for ig in ignored for module in ig.modules()}
        named = dict(root.named_modules())
        missing = [name for name in self.module_names if name not in named or not name]
        if missing:
            raise ValueError(f"AutoWrap.module_names {missing} name no submodule of the {type(root).__name__}")
        wanted = {id(named[name]) for name in self.module_names}
        return [
            module for module in root.modules()
            if module is not root and id(module) not in skip and self._selects(module, wanted)
        ]

    def _selects(self, module: nn.Module, wanted: set[int]) -> bool:
        if self.kind == "always":
            return True
        if self.kind == "module_names":
            return id(module) in wanted
        return isinstance(module, self.module_classes)


def _check_names(names: tuple[str, ...]) -> None:
    bad = [name for name in names if not isinstance(name, str) or not name or name != name.strip(".")]
    if not names or bad:
        raise ValueError(f"AutoWrap(kind='module_names') needs non-empty dotted submodule names, got {names!r}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"AutoWrap.module_names lists {repeated} more than once")
