"""The conformance contract: everything an adapter author or a case author imports.

Public and versioned (:data:`PROTOCOL_VERSION`; its history is in
docs/ADAPTER_GUIDE.md). Nothing here imports the runner, the cases or the
self-test; it needs only torch and the harness.

- :mod:`~conformance.contract.adapter`: the :class:`FSDPAdapter` protocol,
  :class:`Capability`, :class:`WrapSpec` and the other values a case hands an adapter;
- :mod:`~conformance.contract.messages`: the errors, warnings and environment variables cases match;
- :mod:`~conformance.contract.optional`: the optional adapter methods and their defaults;
- :mod:`~conformance.contract.case`: ``@case`` and :class:`CaseSpec`, :class:`NotApplicable`;
- :mod:`~conformance.contract.rows`: row ids and the patterns that name rows;
- :mod:`~conformance.contract.applicability`: whether a row can run against an adapter;
- :mod:`~conformance.contract.registry`: adapters by name (entry points, ``FSDP_CONFORMANCE_ADAPTERS``);
- :mod:`~conformance.contract.results`: :class:`Result` and :class:`CaseReport`.
"""

from conformance.contract.adapter import (
    HYBRID_STRATEGIES,
    PROTOCOL_VERSION,
    STRATEGIES,
    AutoWrap,
    Capability,
    FSDPAdapter,
    MixedPrecisionSpec,
    UnitInfo,
    WrapSpec,
)
from conformance.contract.case import ANY_GPU, CaseSpec, GpuNeed, NotApplicable, case, distinct_gpus, not_applicable
from conformance.contract.results import OUTCOMES, CaseReport, Result
from conformance.contract.rows import format_row_id, parse_row_id, row_matches
from conformance.contract.state_dict_api import StateDictSettingsSpec

__all__ = [
    "ANY_GPU",
    "HYBRID_STRATEGIES",
    "OUTCOMES",
    "PROTOCOL_VERSION",
    "STRATEGIES",
    "AutoWrap",
    "Capability",
    "CaseReport",
    "CaseSpec",
    "FSDPAdapter",
    "GpuNeed",
    "MixedPrecisionSpec",
    "NotApplicable",
    "Result",
    "StateDictSettingsSpec",
    "UnitInfo",
    "WrapSpec",
    "case",
    "distinct_gpus",
    "format_row_id",
    "not_applicable",
    "parse_row_id",
    "row_matches",
]
