"""Refusing, at wrap time, the parts of a ``WrapSpec`` an implementation has no way to express.

A row that needs a capability an adapter does not declare is ``n/a`` before any
rank starts ([Note: requirements are checked once] in
:mod:`conformance.contract.declared`). Adapters for third-party implementations
are also called directly (their own tests, a user's script); there a spec asking
for what the implementation cannot do must fail loudly rather than be ignored.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from conformance.contract.adapter import WrapSpec

__all__ = ["refuse_inexpressible"]


def _used(spec: WrapSpec) -> dict[str, bool]:
    """Each optional ``WrapSpec`` feature a refusal can name -> whether ``spec`` uses it."""
    return {
        "device_mesh": spec.device_mesh is not None,
        "cpu_offload": spec.cpu_offload,
        "sync_module_states": spec.sync_module_states,
        "ignored_modules": bool(spec.ignored_modules),
        "param_init_fn": spec.param_init_fn is not None,
    }


def refuse_inexpressible(name: str, spec: WrapSpec, *, strategies: Collection[str | None],
                         features: Iterable[str]) -> None:
    """ValueError naming ``spec``'s strategy if not in ``strategies``, else the ``features`` it uses
    (sorted), for adapter ``name``."""
    if spec.strategy not in strategies:
        raise ValueError(f"{name} cannot express strategy {spec.strategy!r}")
    used = _used(spec)
    bad = sorted(feature for feature in features if used[feature])
    if bad:
        raise ValueError(f"{name} cannot express {bad}")
