"""An adapter for the suite's own tests: an FSDP whose units come from one root call with a list of module classes.

It is the reference, driven as an implementation whose only way to nest units is a class list given to the
one call that wraps the model (as ``ModuleWrapPolicy`` and transformer class lists are): ``wrap`` refuses a
module that already holds a unit, and so declares no :attr:`Capability.MANUAL_NESTING`. A plan by submodule
names is realised through the class list too: each named module is given a marker subclass of its own class,
and the list names the markers.
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from conformance.adapters.reference import ReferenceAdapter
from conformance.contract.adapter import AutoWrap, Capability, WrapSpec

__all__ = ["ClassListAdapter", "REFUSED_NESTING"]

#: What :meth:`ClassListAdapter.wrap` raises with for a module that already holds a unit.
REFUSED_NESTING = "class-list wraps a model once, its units from a class list"

#: Original class -> its marker subclass (one per class, so that equal plans give equal lists).
_MARKERS: dict[type[nn.Module], type[nn.Module]] = {}


def _marker(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _MARKERS:
        _MARKERS[cls] = type(f"{cls.__name__}Unit", (cls,), {"__module__": __name__})
    return _MARKERS[cls]


class ClassListAdapter(ReferenceAdapter):
    """The reference, its units only ever from one root call's class list."""

    name = "class-list"
    capabilities = ReferenceAdapter.capabilities - {Capability.MANUAL_NESTING}

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        held = [name for name, sub in module.named_modules() if isinstance(sub, self._api().FullyShardedDataParallel)]
        if held:
            raise ValueError(f"{REFUSED_NESTING}: the {type(module).__name__} already holds units {held}")
        if spec.auto_wrap is None:
            return super().wrap(module, spec)
        return super().wrap(module, replace(spec, auto_wrap=AutoWrap(self._classes(module, spec))))

    @staticmethod
    def _classes(module: nn.Module, spec: WrapSpec) -> tuple[type[nn.Module], ...]:
        """The class list realising ``spec.auto_wrap`` on ``module`` (a plan by name: marker classes, set now)."""
        plan = spec.auto_wrap
        assert plan is not None
        if plan.kind == "always":
            return (nn.Module,)
        if plan.kind != "module_names":
            return plan.module_classes
        chosen = plan.units_under(module, spec.ignored_modules)
        for unit in chosen:
            if type(unit) not in _MARKERS.values():
                unit.__class__ = _marker(type(unit))
        classes = tuple(dict.fromkeys(type(unit) for unit in chosen))
        selected = AutoWrap(classes).units_under(module, spec.ignored_modules)
        if [id(unit) for unit in selected] != [id(unit) for unit in chosen]:
            raise ValueError(f"class-list cannot express {plan}: its classes select {len(selected)} modules")
        return classes
