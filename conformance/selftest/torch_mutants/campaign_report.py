"""A campaign's reports: ``torch_mutants.json``, ``torch_mutants.txt`` (a table) and the summary line.

The summary line: ``torch mutants (IMPL): K killed, S survived, T timed out,
N not reached, I import-broken of SAMPLE sampled from POPULATION (seed SEED,
rows '-k EXPR'); score P% of judged; wall W s``. The score is killed over
killed + survived + timed out: the mutants the rows had a chance to notice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conformance.selftest.torch_mutants.campaign import Campaign, Outcome
from conformance.selftest.torch_mutants.verdicts import VERDICTS

__all__ = ["SCHEMA", "counts", "summary_line", "to_json", "to_table", "write_reports"]

#: The JSON report's ``schema_version``.
SCHEMA = 1


def counts(campaign: Campaign) -> dict[str, int]:
    """Mutants per verdict, every verdict present."""
    found = {verdict: 0 for verdict in VERDICTS}
    for outcome in campaign.outcomes:
        found[outcome.verdict.verdict] += 1
    return found


def summary_line(campaign: Campaign) -> str:
    found = counts(campaign)
    judged = found["killed"] + found["survived"] + found["timed out"]
    score = f"{100 * found['killed'] / judged:.0f}%" if judged else "n/a"
    per_verdict = ", ".join(f"{found[verdict]} {verdict}" for verdict in VERDICTS)
    rows = campaign.selection.keyword or "all rows"
    return (f"torch mutants ({campaign.selection.impl}): {per_verdict} of {len(campaign.outcomes)} sampled from "
            f"{campaign.population} (seed {campaign.seed}, rows '{rows}'); score {score} of judged; "
            f"wall {campaign.wall_s:.0f} s")


def _executed(outcome: Outcome) -> bool:
    return bool(outcome.run.markers.hits)


def _mutant_entry(outcome: Outcome) -> dict[str, Any]:
    mutant, run = outcome.mutant, outcome.run
    return {"id": mutant.id, "module": mutant.module, "line": mutant.line, "col": mutant.col,
            "operator": mutant.operator, "before": mutant.before, "after": mutant.after,
            "verdict": outcome.verdict.verdict, "killed_by": list(outcome.verdict.killers),
            "detail": outcome.verdict.detail, "executed": _executed(outcome),
            "processes_imported": len(run.markers.imported),
            "processes_imported_beyond_controller": len(run.imported_beyond_controller()),
            "exit_code": run.returncode,
            "wall_s": round(run.wall_s, 1)}


def to_json(campaign: Campaign, facts: dict[str, Any]) -> dict[str, Any]:
    """The JSON report; ``facts`` (versions, times) are added as they are."""
    baseline = campaign.baseline
    return {
        "schema_version": SCHEMA, **facts,
        "impl": campaign.selection.impl, "keyword": campaign.selection.keyword,
        "rank_mode": campaign.selection.rank_mode, "seed": campaign.seed, "population": campaign.population,
        "sample": len(campaign.outcomes), "timeout_s": round(campaign.timeout_s, 1),
        "wall_s": round(campaign.wall_s, 1), "counts": counts(campaign), "summary": summary_line(campaign),
        "baseline": {"exit_code": baseline.returncode, "wall_s": round(baseline.wall_s, 1),
                     "cells": len((baseline.report or {}).get("rows", [])),
                     "modules_imported": sorted(baseline.markers.modules_imported())},
        "mutants": [_mutant_entry(outcome) for outcome in campaign.outcomes],
    }


def to_table(campaign: Campaign) -> str:
    """One line per mutant (verdict, whether the mutated code ran, mutant id), its killers beneath it."""
    lines = [f"{'verdict':<13}  {'ran':<3}  mutant", f"{'-' * 13}  {'-' * 3}  {'-' * 6}"]
    for outcome in sorted(campaign.outcomes, key=lambda o: (VERDICTS.index(o.verdict.verdict), o.mutant.id)):
        ran = "yes" if _executed(outcome) else "no"
        lines.append(f"{outcome.verdict.verdict:<13}  {ran:<3}  {outcome.mutant.id}")
        lines.extend(f"{'':<20}killed by {killer}" for killer in outcome.verdict.killers)
        if outcome.verdict.detail:
            lines.append(f"{'':<20}{outcome.verdict.detail}")
    return "\n".join([*lines, "", summary_line(campaign), ""])


def write_reports(campaign: Campaign, facts: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``out/torch_mutants.json`` and ``out/torch_mutants.txt``; their paths."""
    json_path, text_path = out / "torch_mutants.json", out / "torch_mutants.txt"
    json_path.write_text(json.dumps(to_json(campaign, facts), indent=2) + "\n")
    text_path.write_text(to_table(campaign))
    return json_path, text_path
