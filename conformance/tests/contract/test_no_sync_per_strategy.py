"""``NO_SYNC`` may hold under some strategies only: ``supports_no_sync(strategy)`` (default: the capability)."""

from __future__ import annotations

from conformance.adapters.reference import ReferenceAdapter
from conformance.contract import optional
from conformance.contract.adapter import Capability
from conformance.contract.applicability import not_applicable_reason
from conformance.contract.case import CaseSpec
from conformance.fuzz.wrapping import missing_operations
from harness.ranks.rank_mode import RankMode

PARAMS = {"rank_mode": "process"}


class NoSyncUnsharded(ReferenceAdapter):
    """``no_sync`` only where gradients are not sharded (as DeepSpeed's ZeRO stage 1)."""

    name = "no-sync-unsharded"

    def supports_no_sync(self, strategy: str | None) -> bool:
        return strategy == "NO_SHARD"


class WithoutNoSync(ReferenceAdapter):
    name = "without-no-sync"
    capabilities = ReferenceAdapter.capabilities - {Capability.NO_SYNC}


def test_the_default_is_the_capability() -> None:
    assert optional.supports_no_sync(ReferenceAdapter(), "FULL_SHARD")
    assert not optional.supports_no_sync(WithoutNoSync(), "NO_SHARD")
    assert optional.supports_no_sync(NoSyncUnsharded(), "NO_SHARD")
    assert not optional.supports_no_sync(NoSyncUnsharded(), None)


def test_a_no_sync_row_is_na_under_a_strategy_the_adapter_refuses_it_for() -> None:
    spec = CaseSpec(id="a/b", requires=[Capability.NO_SYNC])
    assert not_applicable_reason(spec, NoSyncUnsharded(), {**PARAMS, "strategy": "FULL_SHARD"}) == (
        "no-sync-unsharded has no no_sync under strategy FULL_SHARD")
    assert not_applicable_reason(spec, NoSyncUnsharded(), {**PARAMS, "strategy": "NO_SHARD"}) is None
    assert not_applicable_reason(spec, ReferenceAdapter(), {**PARAMS, "strategy": "FULL_SHARD"}) is None
    plain = CaseSpec(id="a/c")
    assert not_applicable_reason(plain, NoSyncUnsharded(), {**PARAMS, "strategy": "FULL_SHARD"}) is None


def test_the_stateful_fuzzer_skips_no_sync_where_the_program_strategy_has_none() -> None:
    adapter = NoSyncUnsharded()
    assert missing_operations(adapter, RankMode.PROCESS, "FULL_SHARD") == {
        "no_sync": "no-sync-unsharded has no no_sync under strategy FULL_SHARD"}
    assert missing_operations(adapter, RankMode.PROCESS, "NO_SHARD") == {}
    assert missing_operations(adapter, RankMode.PROCESS) == {}
