"""A campaign: enumerate the targets' mutants, draw a sample, run the baseline, then each mutant, and judge it.

The baseline runs under an overlay that serves every target module unmutated:
it proves the injection reaches the processes where the rows run (its markers
name the target modules the selection imports) and gives the outcomes and exit
code each mutant is compared with. Each mutant then runs under an overlay
serving its one mutated module, probed (the ``hit`` markers say whether the
mutated code ran at all).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conformance.selftest.torch_mutants.catalog import Mutant, apply, enumerate_mutants, sample
from conformance.selftest.torch_mutants.injection import make_overlay
from conformance.selftest.torch_mutants.suite_run import Selection, run_rows
from conformance.selftest.torch_mutants.verdicts import RunResult, Verdict, classify

__all__ = ["BaselineError", "Campaign", "Outcome", "default_timeout", "draw", "run_campaign"]


class BaselineError(RuntimeError):
    """The unmutated run could not be used as a baseline."""


@dataclass(frozen=True)
class Outcome:
    """A mutant, its run and its verdict."""

    mutant: Mutant
    run: RunResult
    verdict: Verdict


@dataclass(frozen=True)
class Campaign:
    """Everything a report shows."""

    selection: Selection
    seed: int
    population: int
    timeout_s: float
    baseline: RunResult
    outcomes: tuple[Outcome, ...]
    wall_s: float


def draw(sources: dict[str, str], size: int, seed: int) -> tuple[int, list[Mutant]]:
    """The population's size and the seeded sample of ``size`` mutants of ``sources`` (module -> text)."""
    population = [mutant for module in sorted(sources) for mutant in enumerate_mutants(sources[module], module)]
    return len(population), sample(population, size, seed)


def default_timeout(baseline: RunResult) -> float:
    """A mutant's time limit when none is given: three times the baseline's wall time plus 30 s."""
    return 3 * baseline.wall_s + 30


def _baseline(selection: Selection, sources: dict[str, str], out: Path, timeout_s: float) -> RunResult:
    baseline = run_rows(selection, make_overlay(out / "baseline" / "overlay", sources), out / "baseline", timeout_s)
    if baseline.report is None or baseline.timed_out:
        raise BaselineError(f"the unmutated run wrote no report (exit {baseline.returncode}, "
                            f"timed out: {baseline.timed_out}); see {out / 'baseline' / 'run.log'}")
    if not baseline.imported_beyond_controller():
        raise BaselineError(f"no process of the unmutated run but its controller imported any of {sorted(sources)}: "
                            "the selection runs no row in a rank, or the overlay is not reaching the rank processes")
    return baseline


def run_campaign(selection: Selection, sources: dict[str, str], size: int, seed: int, out: Path,
                 timeout_s: float | None, progress: Callable[[str], None]) -> Campaign:
    """Run the baseline and ``size`` mutants of ``sources`` drawn with ``seed``; runs write under ``out``."""
    start = time.monotonic()
    population, chosen = draw(sources, size, seed)
    progress(f"{population} mutants of {len(sources)} modules; {len(chosen)} drawn with seed {seed}")
    baseline = _baseline(selection, sources, out, timeout_s or 3600.0)
    limit = timeout_s or default_timeout(baseline)
    progress(f"baseline: exit {baseline.returncode} in {baseline.wall_s:.0f} s; "
             f"imported {sorted(baseline.markers.modules_imported())}; mutant time limit {limit:.0f} s")
    outcomes = []
    for i, mutant in enumerate(chosen):
        workdir = out / "mutants" / f"{i:04d}"
        overlay = make_overlay(workdir / "overlay", {mutant.module: apply(sources[mutant.module], mutant, probe=True)})
        run = run_rows(selection, overlay, workdir, limit)
        verdict = classify(baseline, run)
        outcomes.append(Outcome(mutant, run, verdict))
        progress(f"[{i + 1}/{len(chosen)}] {verdict.verdict:<13} {run.wall_s:5.0f} s  {mutant.id}")
    return Campaign(selection, seed, population, limit, baseline, tuple(outcomes), time.monotonic() - start)
