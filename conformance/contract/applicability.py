"""Whether a case row can run against an adapter, decided before any rank starts.

One function, :func:`not_applicable_reason`, used by the plugin (the row is
``n/a`` with this reason) and by ``fsdp-conformance list --impl NAME`` (the
preview of the ``n/a`` rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from conformance.contract.adapter import Capability
from conformance.contract.case import CaseSpec
from conformance.contract.optional import capabilities_of, supports_no_sync, thread_rank_limits
from harness.ranks.rank_mode import RankMode, excluded_reason

__all__ = ["missing_reason", "not_applicable_reason"]


def not_applicable_reason(spec: CaseSpec, adapter: Any, params: Mapping[str, Any]) -> str | None:
    """Why this row (``params`` include ``rank_mode``) cannot run against ``adapter``, or ``None``.

    In order: the row's rank mode is one the case does not declare
    ([Note: rank modes] in :mod:`harness.ranks.rank_mode`); a capability the row
    requires is not declared, or not on this rank mode (:func:`missing_reason`);
    a strategy the row wraps with (the default strategy for a row that declares none) is refused by
    ``adapter.supports_strategy``, or, for a row requiring ``NO_SYNC``, by ``supports_no_sync``
    (:mod:`conformance.contract.optional`); or it supports none of the strategies the row draws from
    ([Note: a row's strategies] in :mod:`conformance.contract.case`).
    """
    mode = RankMode(params["rank_mode"])
    excluded = excluded_reason(mode, spec.modes)
    if excluded is not None:
        return f"{spec.id} is {excluded}"
    required = spec.required(params)
    missing = missing_reason(adapter, required, mode)
    if missing is not None:
        return missing
    refused = [str(s) for s in spec.strategies_for(params) if not adapter.supports_strategy(s)]
    if refused:
        return f"{adapter.name} does not support strategy {', '.join(refused)}"
    if Capability.NO_SYNC in required:
        unsynced = [str(s) for s in spec.strategies_for(params) if not supports_no_sync(adapter, s)]
        if unsynced:
            return f"{adapter.name} has no no_sync under strategy {', '.join(unsynced)}"
    drawn = spec.draws_strategies
    if drawn and not any(adapter.supports_strategy(s) for s in drawn):
        return f"{adapter.name} supports none of the strategies {spec.id} draws from ({', '.join(drawn)})"
    return None


def missing_reason(adapter: Any, required: Iterable[Capability], mode: RankMode) -> str | None:
    """Why ``adapter`` cannot provide ``required`` on ``mode`` ranks, or ``None``.

    Capabilities fail closed: only what the adapter declares counts, so a
    capability added to the suite later is missing for every adapter until
    it opts in. On thread ranks, a declared capability listed in the
    adapter's ``thread_rank_limits`` is missing too, with the adapter's reason.
    """
    required = list(required)
    declared = capabilities_of(adapter)
    missing = [str(c) for c in required if c not in declared]
    if missing:
        return f"{adapter.name} lacks capability {', '.join(missing)}"
    if mode is RankMode.THREAD:
        limits = thread_rank_limits(adapter)
        limited = [c for c in required if c in limits]
        if limited:
            return "; ".join(f"{adapter.name} has {c} on process ranks only: {limits[c]}" for c in limited)
    return None
