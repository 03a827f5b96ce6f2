"""Whether a case row can run against an adapter, decided before any rank starts.

One function, :func:`not_applicable_reason`, used by the plugin (the row is
``n/a`` with this reason) and by ``fsdp-conformance list --impl NAME`` (the
preview of the ``n/a`` rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conformance.contract.case import CaseSpec
from conformance.contract.optional import capabilities_of
from harness.rank_mode import RankMode, excluded_reason

__all__ = ["not_applicable_reason"]


def not_applicable_reason(spec: CaseSpec, adapter: Any, params: Mapping[str, Any]) -> str | None:
    """Why this row (``params`` include ``rank_mode``) cannot run against ``adapter``, or ``None``.

    In order: the row's rank mode is one the case does not declare
    ([Note: rank modes] in :mod:`harness.rank_mode`); a capability the row
    requires is not declared; a strategy the row wraps with is refused by
    ``adapter.supports_strategy``.
    """
    excluded = excluded_reason(RankMode(params["rank_mode"]), spec.modes)
    if excluded is not None:
        return f"{spec.id} is {excluded}"
    capabilities = capabilities_of(adapter)
    missing = [str(c) for c in spec.required(params) if c not in capabilities]
    if missing:
        return f"{adapter.name} lacks capability {', '.join(missing)}"
    refused = [str(s) for s in spec.strategies_for(params) if not adapter.supports_strategy(s)]
    if refused:
        return f"{adapter.name} does not support strategy {', '.join(refused)}"
    return None
