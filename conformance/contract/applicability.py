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

__all__ = ["RANK_MODES", "not_applicable_reason"]

#: Rank modes a case row can have; anything else means the selection excluded every mode the case declares.
RANK_MODES = ("process", "thread", "launched")


def not_applicable_reason(spec: CaseSpec, adapter: Any, params: Mapping[str, Any]) -> str | None:
    """Why this row (``params`` include ``rank_mode``) cannot run against ``adapter``, or ``None``.

    In order: the selected rank mode is one the case does not declare; a
    capability the row requires is not declared; a strategy the row wraps with
    is refused by ``adapter.supports_strategy``.
    """
    if params.get("rank_mode") not in RANK_MODES:
        return f"{spec.id} runs on {'/'.join(spec.modes)} ranks only, which the selected rank mode excludes"
    capabilities = capabilities_of(adapter)
    missing = [str(c) for c in spec.required(params) if c not in capabilities]
    if missing:
        return f"{adapter.name} lacks capability {', '.join(missing)}"
    refused = [str(s) for s in spec.strategies_for(params) if not adapter.supports_strategy(s)]
    if refused:
        return f"{adapter.name} does not support strategy {', '.join(refused)}"
    return None
