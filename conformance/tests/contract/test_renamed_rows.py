"""Renamed row ids ([Note: renamed rows] in conformance.contract.rows): the table against the catalog and the
guide, and an old id read as the new one."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

from conformance.contract import moved
from conformance.contract.rows import RENAMED_ROWS, current_row_id, renamed_row, row_matches
from conformance.runner.listing import CASES_DIR

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "ADAPTER_GUIDE.md"
OLD, NEW = "fuzz/repro_8fc450e8", "fuzz/repro_no_shard_unused_unit_params"


def _case_ids() -> set[str]:
    ids: set[str] = set()
    for path in CASES_DIR.glob("test_*.py"):
        module = importlib.import_module(f"conformance.cases.{path.stem}")
        ids |= {m.args[0].id for fn in vars(module).values() for m in getattr(fn, "pytestmark", ())
                if m.name == "conformance"}
    return ids


def test_every_new_id_is_a_case_and_no_old_id_is() -> None:
    ids = _case_ids()
    assert not set(RENAMED_ROWS) & ids, sorted(set(RENAMED_ROWS) & ids)
    assert set(RENAMED_ROWS.values()) <= ids, sorted(set(RENAMED_ROWS.values()) - ids)
    assert len(set(RENAMED_ROWS.values())) == len(RENAMED_ROWS), "two old ids renamed to one row"


def test_the_fuzzers_reproducers_are_named_by_behaviour_and_still_selected_as_reproducers() -> None:
    """Every reproducer row once named by a hash is renamed, keeping ``fuzz/repro_`` (``-k repro``, ``fuzz/*``)."""
    ids = _case_ids()
    assert not [i for i in ids if re.fullmatch(r"fuzz/repro_[0-9a-f]{8}", i)]
    assert len(RENAMED_ROWS) == 14
    for old, new in RENAMED_ROWS.items():
        assert re.fullmatch(r"fuzz/repro_[0-9a-f]{8}", old), old
        assert re.fullmatch(r"fuzz/repro_[a-z0-9]+(?:_[a-z0-9]+)+", new), new
        assert row_matches(new, "fuzz/*")


def test_an_old_id_reads_as_the_new_one_with_its_parameters_and_warns_where_given() -> None:
    assert renamed_row(OLD) == NEW and renamed_row(f"{OLD}[x=1,y=2]") == f"{NEW}[x=1,y=2]"
    assert renamed_row(NEW) is None and renamed_row("fuzz/*") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert current_row_id(OLD) == NEW  # no place named: silent (a report's rows)
        assert current_row_id("training/x[a=1]", "--row") == "training/x[a=1]"
    with pytest.warns(DeprecationWarning) as caught:
        assert current_row_id(f"{OLD}[x=1]", "--row") == f"{NEW}[x=1]"
    message = str(caught[0].message)
    assert f"--row: row id '{OLD}[x=1]' is renamed '{NEW}[x=1]'" in message
    assert f"accepted until fsdp-conformance {moved.REMOVED_IN} " in message


def test_the_guide_lists_every_renamed_row() -> None:
    """docs/ADAPTER_GUIDE.md, section 8: a table row ``| `old` | `new` |`` for each renamed row."""
    listed = dict(re.findall(r"^\s*\| `(fuzz/repro_[0-9a-f]{8})` \| `([^`]+)` \|$", GUIDE.read_text(), re.M))
    assert listed == RENAMED_ROWS
