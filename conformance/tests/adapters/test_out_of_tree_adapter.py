"""Acceptance: a third-party adapter package, registered only in its own metadata, gets an honest matrix.

The package lives in a temporary directory with its own ``*.dist-info``
(entry point ``fsdp_conformance.adapters``); nothing of it is in this
project's metadata. Its implementation has neither NO_SHARD nor hybrid
sharding: those rows must be ``n/a`` with the reason, the others must run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conformance.contract import registry
from conformance.contract.rows import parse_row_id
from conformance.runner import cli
from conformance.tests.installed import fake_distribution
from harness.tests.inprocess import MainResult, run_main

ADAPTER = '''
from conformance.contract.adapter import Capability
from conformance.adapters.reference import ReferenceAdapter
from conformance.tests.installed import fake_distribution

_HYBRID = {Capability.HYBRID_VIA_PG_TUPLE, Capability.HYBRID_AUTO_GROUPS, Capability.HYBRID_MANUAL_WRAP_CHECK,
           Capability.HYBRID_PG_VALIDATION}


class NoReplicationAdapter(ReferenceAdapter):
    """An implementation that only shards: no NO_SHARD, no hybrid strategies."""

    name = "no-replication"
    capabilities = ReferenceAdapter.capabilities - _HYBRID

    def supports_strategy(self, strategy):
        return strategy in (None, "FULL_SHARD", "SHARD_GRAD_OP")
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A directory holding the package and its dist-info, as an installed distribution would."""
    return fake_distribution(tmp_path / "site", "no-replication-fsdp", "0.1",
                             "[fsdp_conformance.adapters]\nno-replication = no_replication_fsdp:NoReplicationAdapter\n",
                             package=("no_replication_fsdp", ADAPTER))


def _cli(*args: str) -> MainResult:
    return run_main(cli.main, *args)


def test_out_of_tree_adapter_rows_are_na_for_what_it_lacks(site: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert "no-replication" not in registry.registered(), "the adapter must come only from its own dist-info"
    for name in [name for name in os.environ if name.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.syspath_prepend(site)  # as if installed: its dist-info's entry point registers it
    selection = "world_size_1_no_shard_warning or manual_wrap_requires_pg or cpu_training_parity_vs_ddp"
    preview = _cli("list", "--impl", "no-replication", "-k", selection)
    assert preview.returncode == 0, preview.stderr
    assert "n/a (process/thread): no-replication does not support strategy NO_SHARD" in preview.stdout
    out = tmp_path / "r.json"
    run = _cli("run", "--impl", "no-replication", "--rank-mode", "thread", "-k", selection, "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["rank_mode"] for r in rows} == {"thread"}
    by_case: dict[str, list[str]] = {}
    for row in rows:
        case, params = parse_row_id(row["case"])
        by_case.setdefault(case, []).append(row["outcome"])
        strategy = params.get("strategy")
        if case == "hybrid_shard/manual_wrap_requires_pg":
            expected = ("n/a", "no-replication lacks capability hybrid_manual_wrap_check")
        elif strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
            # These rows give their hybrid groups as a (shard, replicate) tuple: the missing capability
            # is named before the unsupported strategy.
            expected = ("n/a", "no-replication lacks capability hybrid_via_pg_tuple")
        elif strategy == "NO_SHARD":
            expected = ("n/a", f"no-replication does not support strategy {strategy}")
        else:
            expected = ("pass", "")
        assert (row["outcome"], row["reason"]) == expected, row
    assert {"pass", "n/a"} <= set(by_case["training/cpu_training_parity_vs_ddp"])
    assert {"pass", "n/a"} <= set(by_case["construction/world_size_1_no_shard_warning"])
