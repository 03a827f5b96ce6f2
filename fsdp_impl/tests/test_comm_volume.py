"""The reference communicates exactly the theoretical minimum per step (bench.comm_volume's table)."""

from __future__ import annotations

import pytest

import harness
from bench.comm_volume import measure_step
from conformance.contract.adapter import HYBRID_STRATEGIES, STRATEGIES


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reference_matches_theory_on_every_rank(strategy: str) -> None:
    world_size = 4 if strategy in HYBRID_STRATEGIES else 2
    per_rank = harness.run(measure_step, world_size=world_size, mode="thread", args=("reference", strategy))
    for rank, result in enumerate(per_rank):
        assert result["theory"], "the theory table is empty; the check would be vacuous"
        assert result["measured"] == result["theory"], f"rank {rank}: {result}"
