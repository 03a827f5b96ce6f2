"""The world size each row of this run runs at ([Note: world sizes] in :mod:`conformance.contract.world_size`).

Process and thread ranks run a row at the run's ``--world-size`` (``FSDP_WORLD_SIZE``), else at its
case's default; a launched job runs every row at the job's size, which the setting may only repeat.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conformance.contract.case import CaseSpec
from conformance.contract.world_size import SizeDecision, decide_world_size
from conformance.runner.settings import Settings

__all__ = ["check_launched_size", "row_world_size"]


def check_launched_size(settings: Settings, job_size: str | None) -> None:
    """A launched job runs its rows at its own size ``job_size`` (``WORLD_SIZE``); ValueError naming a
    ``--world-size`` that asks for another."""
    asked = settings.world_size
    if asked.value is not None and str(asked.value) != job_size:
        raise ValueError(f"{asked.source} {asked.value} with launched ranks: a launched job runs its rows at its "
                         f"own size (WORLD_SIZE={job_size}); leave it out")


def row_world_size(spec: CaseSpec, params: Mapping[str, Any], settings: Settings, *,
                   launched: bool) -> SizeDecision:
    """The ranks the row of ``spec`` with ``params`` runs on in this run, or why it is skipped."""
    need = spec.need_for(params)
    if launched:
        from harness.ranks.launched import job_env  # imports torch: only a launched job needs it

        job = job_env()
        return decide_world_size(need, launched_job=job["WORLD_SIZE"], node_ranks=job["LOCAL_WORLD_SIZE"])
    return decide_world_size(need, requested=settings.world_size.value)
