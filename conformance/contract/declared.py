"""The adapter a case body receives: it refuses a wrap that needs more than the row declared.

[Note: requirements are checked once]
Whether a row can run is decided once, before any rank starts, from what the
case declares (``requires``, strategies, rank modes) and what the adapter
declares (:func:`conformance.contract.applicability.not_applicable_reason`).
That decision is only as good as the declaration: a case that wraps with,
say, ``cpu_offload=True`` but forgets ``Capability.CPU_OFFLOAD`` would reach
an adapter that cannot offload, which then either fails the row (blaming the
implementation for the case's omission) or silently ignores the flag (a false
pass). So the body gets the adapter behind :class:`DeclaredAdapter`, which
compares every :meth:`WrapSpec.required` with the row's declared capabilities
and raises :class:`UndeclaredCapability` (an error in the case, the same for
every adapter, so the reference's own run catches it) instead of wrapping.
Adapters therefore never re-check capabilities at wrap time.

Strategies are checked alike: a wrap whose strategy the row did not declare
(:meth:`conformance.contract.case.CaseSpec.strategies_for`, the default strategy
for a row that declares none) and the adapter's ``supports_strategy`` refuses
raises :class:`UndeclaredStrategy` instead of reaching the adapter, whose
refusal would otherwise be reported as its FAIL ([Note: a row's strategies]
in :mod:`conformance.contract.case`). A strategy the adapter supports is never
refused here: the fuzzers draw from those.

[Note: manual nesting is declared]
Nesting is a plan the adapter realises (``WrapSpec.auto_wrap``, :mod:`conformance.contract.plan`).
A ``wrap`` of a module that holds a module an earlier ``wrap`` of the row took or returned is FSDP1's
manual nesting, which not every implementation has; a row doing it without declaring
:attr:`Capability.MANUAL_NESTING` raises :class:`UndeclaredCapability` here, before the adapter is
called, so that the reference's own run catches the case. Wrapping disjoint submodules and leaving
the root unwrapped is no nesting.

[Note: plans for older adapters]
Plans by submodule name (``AutoWrap(kind="module_names")``) are protocol 3. An adapter declaring an
older ``protocol_version`` was written before them, when cases nested ``wrap`` calls themselves; it
gets such a plan realised here as those calls: each unit wrapped with the spec (no plan; the ignored
modules inside it), deepest first, put back where it was, then the root, until fsdp-conformance 0.3
(docs/ADAPTER_GUIDE.md, section 8).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch.nn as nn

from conformance.contract.adapter import Capability, WrapSpec
from conformance.contract.optional import protocol_version

#: The protocol version that brought plans by submodule name ([Note: plans for older adapters]).
NAME_PLANS_SINCE = 3

__all__ = ["DeclaredAdapter", "UndeclaredCapability", "UndeclaredStrategy"]


class UndeclaredCapability(RuntimeError):
    """A case wrapped with a spec needing a capability its ``requires`` does not list."""


class UndeclaredStrategy(RuntimeError):
    """A case wrapped with a strategy its row does not declare, which the adapter refuses."""


class DeclaredAdapter:
    """``adapter`` as seen by one row of ``case_id``, which declared ``declared``.

    Every attribute is the adapter's own, except :meth:`wrap`, which first checks
    the spec against the declaration. Picklable (process ranks receive it).
    """

    def __init__(self, adapter: Any, declared: Iterable[Capability], case_id: str,
                 strategies: Iterable[str | None] = ()) -> None:
        self.__dict__.update(_adapter=adapter, _declared=frozenset(declared), _case_id=case_id,
                             _strategies=tuple(strategies), _wrapped=weakref.WeakSet())

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if name != "_wrapped"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _wrapped=weakref.WeakSet())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_adapter" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._adapter, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._adapter, name, value)

    def __repr__(self) -> str:
        return f"DeclaredAdapter({self._adapter!r}, case {self._case_id!r})"

    @property
    def unwrapped(self) -> Any:
        """The adapter itself."""
        return self._adapter

    def wrap(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        undeclared = [c for c in spec.required() if c not in self._declared]
        if undeclared:
            names = ", ".join(f"Capability.{c.name}" for c in undeclared)
            raise UndeclaredCapability(
                f"case {self._case_id} wraps with a spec needing {names}, which its requires does not "
                f"declare (declared: {', '.join(sorted(str(c) for c in self._declared)) or 'nothing'}); "
                "add it to the case's requires so that adapters without it report n/a"
            )
        self._check_strategy(spec.strategy)
        self._check_nesting(module)
        by_name = spec.auto_wrap is not None and spec.auto_wrap.kind == "module_names"
        if by_name and protocol_version(self._adapter) < NAME_PLANS_SINCE:
            wrapped = self._nested_by_hand(module, spec)
        else:
            wrapped = self._adapter.wrap(module, spec)
        self._wrapped.update((module, wrapped))
        return wrapped

    def _nested_by_hand(self, module: nn.Module, spec: WrapSpec) -> nn.Module:
        """[Note: plans for older adapters]."""
        assert spec.auto_wrap is not None
        names = {id(sub): name for name, sub in module.named_modules()}
        units = spec.auto_wrap.units_under(module, spec.ignored_modules)
        for unit in sorted(units, key=lambda sub: names[id(sub)].count("."), reverse=True):
            inside = {id(sub) for sub in unit.modules()}
            ignored = tuple(sub for sub in spec.ignored_modules if id(sub) in inside)
            parent_path, _, attr = names[id(unit)].rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            setattr(parent, attr, self._adapter.wrap(unit, replace(spec, auto_wrap=None, ignored_modules=ignored)))
        return self._adapter.wrap(module, replace(spec, auto_wrap=None))  # type: ignore[no-any-return]

    def _check_nesting(self, module: nn.Module) -> None:
        """[Note: manual nesting is declared]."""
        if Capability.MANUAL_NESTING in self._declared:
            return
        inner = [name for name, sub in module.named_modules() if sub in self._wrapped]
        if inner:
            raise UndeclaredCapability(
                f"case {self._case_id} wraps a {type(module).__name__} holding modules it wrapped before "
                f"({', '.join(repr(name) for name in inner[:3])}): manual nesting, which its requires does not "
                "declare (Capability.MANUAL_NESTING); describe the units as a plan (WrapSpec.auto_wrap, "
                "AutoWrap.submodules) or declare the capability if manual nesting is what the row tests"
            )

    def _check_strategy(self, strategy: str | None) -> None:
        if strategy in self._strategies or self._adapter.supports_strategy(strategy):
            return
        declared = ", ".join(str(s) for s in self._strategies) or "none"
        raise UndeclaredStrategy(
            f"case {self._case_id} wraps with strategy {strategy}, which {self._adapter.name} does not support and "
            f"the row does not declare (declared: {declared}); declare it (a strategy grid parameter or the "
            "case's strategies) so that the row is n/a for adapters without it"
        )
