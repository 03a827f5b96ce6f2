"""Matrix row ids: one case at one point of its parameter grid.

A row id is the case id followed by its grid parameters, named, in the order
the case's ``parametrize`` decorators declare them::

    checkpoint/checkpoint_fsdp_wrapping[nesting=roots,use_orig_params=False,offload_activations=True,cpu_offload=True]

The implementation and the rank mode are columns of the matrix, not part of
the row. :func:`case_row_id` is the only place that builds a row id from a
collected item; the plugin, the CLI's ``list`` and reports all use it.
Patterns (mutant expectations, known findings) name a case and, optionally, a
subset of its parameters in any order: :func:`row_matches`.

[Note: renamed rows]
Row ids are a published surface: users select rows by id (``--row``,
``--rows-from``), compare a run with an earlier report (``--expect``), and
packages register findings against row patterns. A case whose id is renamed
keeps its old id in :data:`RENAMED_ROWS` (old case id -> new case id) until
:data:`~conformance.contract.moved.REMOVED_IN`, the version that drops the
moved module paths too (docs/ADAPTER_GUIDE.md, section 8). Until then every
place that reads a row id from a user or a package reads an old one as the new
one (:func:`current_row_id`, parameters kept): ``--row`` and a findings
registration's ``rows`` warn naming the new id (``DeprecationWarning``, and
``--row`` a line on the terminal); the rows of a report read by ``--rows-from``
or ``--expect`` take the new ids silently, so a baseline written before the
rename compares cell by cell with no change.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import pytest

from conformance.contract.case import CaseSpec
from conformance.contract.moved import REMOVED_IN

__all__ = ["COLUMN_PARAMS", "RENAMED_ROWS", "all_params", "case_params", "case_row_id", "case_spec",
           "current_row_id", "format_row_id", "parse_row_id", "renamed_message", "renamed_row", "row_matches"]

#: Parameters that select a matrix column rather than a row.
COLUMN_PARAMS = ("impl", "rank_mode")

#: Renamed cases: old case id -> new case id, the old accepted until ``REMOVED_IN`` ([Note: renamed rows]).
#: The fuzzer's reproducers, first named by a hash of their program, now by the behaviour they pin.
RENAMED_ROWS: dict[str, str] = {
    "fuzz/repro_8fc450e8": "fuzz/repro_no_shard_unused_unit_params",
    "fuzz/repro_d61e5cb1": "fuzz/repro_summon_grads_float64_padding_shard",
    "fuzz/repro_57555c45": "fuzz/repro_no_shard_low_precision_accumulation",
    "fuzz/repro_6ec378a7": "fuzz/repro_buffer_dtype_state_dict_before_forward",
    "fuzz/repro_438854a6": "fuzz/repro_no_grad_forward_before_step",
    "fuzz/repro_3ff502a0": "fuzz/repro_no_grad_forward_unsharded_params",
    "fuzz/repro_49d9e993": "fuzz/repro_full_optim_load_before_first_step",
    "fuzz/repro_445b0205": "fuzz/repro_full_state_dict_mid_iteration_bf16",
    "fuzz/repro_5e69d8c9": "fuzz/repro_buffer_dtype_checkpointed_state_dict",
    "fuzz/repro_ff3cd83a": "fuzz/repro_sharded_state_dict_before_recompute",
    "fuzz/repro_27b1c63e": "fuzz/repro_no_sync_bf16_accumulation",
    "fuzz/repro_c8d7309a": "fuzz/repro_no_sync_float32_reduce_accumulation",
    "fuzz/repro_c34640a2": "fuzz/repro_optim_state_dict_before_first_step_adam",
    "fuzz/repro_972f9ad8": "fuzz/repro_reentrant_checkpoint_root_params",
}


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


def renamed_row(row_id: str) -> str | None:
    """The current id of ``row_id`` (a row id or a pattern, parameters kept) when its case was renamed
    ([Note: renamed rows]); ``None`` when it was not."""
    case_id, bracket, rest = row_id.partition("[")
    new = RENAMED_ROWS.get(case_id)
    return None if new is None else new + bracket + rest


def current_row_id(row_id: str, where: str = "", stacklevel: int = 2) -> str:
    """``row_id`` under its current name; a renamed one warns (``DeprecationWarning`` naming the new id, and
    ``where`` it was given) unless ``where`` is empty."""
    new = renamed_row(row_id)
    if new is None:
        return row_id
    if where:
        warnings.warn(renamed_message(row_id, new, where), DeprecationWarning, stacklevel=stacklevel + 1)
    return new


def renamed_message(old: str, new: str, where: str) -> str:
    """What a renamed row id given in ``where`` warns."""
    return (f"{where}: row id {old!r} is renamed {new!r}; the old id is accepted until fsdp-conformance "
            f"{REMOVED_IN} ([Note: renamed rows] in conformance.contract.rows)")
