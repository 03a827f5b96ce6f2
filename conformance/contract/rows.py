"""Matrix row ids: one case at one point of its parameter grid.

A row id is the case id followed by its grid parameters, named, in the order
the case's ``parametrize`` decorators declare them::

    checkpoint/checkpoint_fsdp_wrapping[nesting=roots,use_orig_params=False,offload_activations=True,cpu_offload=True]

The implementation and the rank mode are columns of the matrix, not part of
the row. :func:`case_row_id` is the only place that builds a row id from a
collected item; the plugin, the CLI's ``list`` and reports all use it.
Patterns (mutant expectations, known findings) name a case and, optionally, a
subset of its parameters in any order: :func:`row_matches`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from conformance.contract.case import CaseSpec

__all__ = ["COLUMN_PARAMS", "case_spec", "all_params", "case_params", "case_row_id", "format_row_id", "parse_row_id",
           "row_matches"]

#: Parameters that select a matrix column rather than a row.
COLUMN_PARAMS = ("impl", "rank_mode")


def case_spec(item: pytest.Item) -> CaseSpec | None:
    """The :class:`CaseSpec` of a conformance case item, ``None`` for any other test."""
    marker = item.get_closest_marker("conformance")
    return None if marker is None else marker.args[0]


def all_params(item: pytest.Item) -> dict[str, Any]:
    """Every parametrized value of ``item``, columns included."""
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def case_params(item: pytest.Item) -> dict[str, Any]:
    """The grid parameters that make up the row (implementation and rank mode left out)."""
    return {k: v for k, v in all_params(item).items() if k not in COLUMN_PARAMS}


def case_row_id(item: pytest.Item) -> str:
    """The row id of a conformance case item (see the module docstring)."""
    spec = case_spec(item)
    if spec is None:
        raise ValueError(f"{item.nodeid} is not a conformance case (no @case declaration)")
    return format_row_id(spec.id, case_params(item))


def _value_text(name: str, value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        text = str(value)
    else:
        text = getattr(value, "__name__", type(value).__name__)
    bad = [c for c in ",=[]" if c in text]
    if bad:
        raise ValueError(f"parameter {name}={text!r}: a row-id value may not contain {''.join(bad)!r}")
    return text


def format_row_id(case_id: str, params: Mapping[str, Any]) -> str:
    """``case_id[name=value,...]``, or the bare case id for a case without a grid."""
    if not params:
        return case_id
    return f"{case_id}[{','.join(f'{k}={_value_text(k, v)}' for k, v in params.items())}]"


def parse_row_id(row_id: str) -> tuple[str, dict[str, str]]:
    """``(case_id, {name: value text})`` from a row id or a pattern."""
    case_id, bracket, rest = row_id.partition("[")
    if not bracket:
        return case_id, {}
    if not rest.endswith("]"):
        raise ValueError(f"row id {row_id!r}: expected 'area/name[name=value,...]'")
    params: dict[str, str] = {}
    for part in filter(None, rest[:-1].split(",")):
        name, eq, value = part.partition("=")
        if not eq or not name:
            raise ValueError(f"row id {row_id!r}: {part!r} is not name=value")
        params[name.strip()] = value.strip()
    return case_id, params


def row_matches(row_id: str, pattern: str) -> bool:
    """Whether ``row_id`` is the case ``pattern`` names, with every parameter the pattern gives.

    ``construction/unsafe_setattr`` matches every row of that case;
    ``construction/unsafe_setattr[env_value=1]`` only the rows with ``env_value=1``,
    whatever the other parameters; ``checkpoint/*`` every case of the area.
    """
    row_case, row_params = parse_row_id(row_id)
    pattern_case, pattern_params = parse_row_id(pattern)
    if pattern_case.endswith("/*"):
        same_case = row_case.split("/", 1)[0] == pattern_case[:-2]
    else:
        same_case = row_case == pattern_case
    return same_case and all(row_params.get(k) == v for k, v in pattern_params.items())
