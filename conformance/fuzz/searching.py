"""The stateful fuzzer's search: programs drawn per world size, run and shrunk on every rank
([Note: stateful programs] in :mod:`conformance.fuzz.ops`), going past the registered findings it meets.

[Note: known findings in a search]
A row's search draws its whole budget, whatever registered findings it meets on
the way. A program whose failure a finding registered for the row and
implementation claims (its ``reason`` matches the row's reason that failure
would give, :func:`headline`, as the case raises it: without the ``rank 0
raised AssertionError:`` the harness puts before it, so a pattern anchored on
that claims nothing here; ``CaseSettings.known_failures``) is recorded with
the finding, is no failure to shrink, and what the finding names in
``set_aside`` (configuration features and operations, :data:`SET_ASIDE`) is
left out of every program drawn after it, as a feature the adapter lacks is: the
draws keep their shape, so the seed still draws the programs it would have,
less what is set aside. A finding that sets nothing aside may claim later
programs again. The first failure no finding claims is the row's failure,
shrunk as any (from then on nothing more is set aside or recorded, so that
shrinking replays what it drew, and a shrinking try a finding claims is no
failure: the program reported is the unknown failure's). The row then FAILs
with that failure and lists the findings met before it; with known findings
alone it FAILs with the first one met (its reason is what the finding claims,
so the runner labels the row with it) and lists every one, each with its
program (not shrunk: it is a known failure) and the operation that failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conformance.contract.adapter import FSDPAdapter
from conformance.contract.case import CaseSettings, KnownFailure
from conformance.contract.results import CaseReport
from conformance.fuzz.agreement import RanksParted
from conformance.fuzz.drawing import SET_ASIDE, programs
from conformance.fuzz.driver import FuzzSettings, Search, found_example, search
from conformance.fuzz.example import FUZZ_STRATEGIES, source
from conformance.fuzz.ops import FEATURES, Program
from conformance.fuzz.stateful import check_program
from conformance.fuzz.wrapping import features_of, missing_operations, render_program

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["MAIN_JOB_PROGRAMS", "SEARCH_S", "SET_ASIDE", "KnownFindings", "budget", "failure_text", "headline",
           "stateful_fuzz", "stateful_row"]

#: Programs per world size in the main job (see docs/PERFORMANCE.md for what they cost).
MAIN_JOB_PROGRAMS = {1: 5, 2: 5, 4: 2}
#: Seconds after which a search stops shrinking ([Note: shrinking within a budget] in
#: :mod:`conformance.fuzz.driver`): the rows' 120 s timeout less the pool's start and the last programs run.
SEARCH_S = 75.0


def budget(settings: CaseSettings, world_size: int) -> int:
    """Programs to draw at ``world_size``: ``--fuzz-stateful-examples`` (``FSDP_FUZZ_STATEFUL_EXAMPLES``),
    else the main job's."""
    given = settings.fuzz_stateful_examples
    return given if given is not None else MAIN_JOB_PROGRAMS.get(world_size, 1)


def headline(seed: int, program: Program, failure: str) -> str:
    """The reason a row gives for ``program`` failing with ``failure``: the policy on it, since a row's reason
    is its first line and a finding may hinge on the policy."""
    policy = program.config.policy
    under = "" if policy is None else f", policy={policy}"
    return f"stateful fuzzer (seed {seed}{under}): {failure}"


@dataclass
class KnownFindings:
    """The findings a row's search may meet, and what those it met set aside ([Note: known findings in a
    search]); ``set_aside`` is the set the drawing strategy reads."""

    known: tuple[KnownFailure, ...]
    seed: int
    set_aside: set[str] = field(default_factory=set)
    settled: bool = False  # a failure no finding claims was met: nothing more is set aside

    def __post_init__(self) -> None:
        for finding in self.known:
            unknown = sorted(set(finding.set_aside) - SET_ASIDE)
            if unknown:
                raise ValueError(f"the finding {finding.doc} sets aside {unknown}, which the stateful fuzzer does "
                                 f"not draw; expected some of {sorted(SET_ASIDE)}")

    def claim(self, program: Program, failure: str) -> str | None:
        """The write-up of the finding that claims ``program`` failing with ``failure``, or ``None``."""
        line = headline(self.seed, program, failure)
        finding = next((known for known in self.known if known.claims(line)), None)
        if finding is None:
            self.settled = True
            return None
        if not self.settled:
            self.set_aside.update(finding.set_aside)
        return finding.doc


def stateful_fuzz(ctx: RankContext, impl: FSDPAdapter, settings: CaseSettings) -> Search:
    """Draw, run and shrink programs on every rank (collective; every rank returns rank 0's result)."""
    strategies = [s for s in FUZZ_STRATEGIES if impl.supports_strategy(s)]
    known = KnownFindings(settings.known_failures, settings.fuzz_seed)
    drawn = programs(ctx.world_size, strategies, features_of(impl), set_aside=known.set_aside)
    config = FuzzSettings.of(settings)
    try:
        return search(ctx, impl, drawn, check_program, budget=budget(settings, ctx.world_size), config=config,
                      counted=lambda program: len(program.ops), claim=known.claim, shrink_s=SEARCH_S)
    except RanksParted as parted:  # [Note: fuzz verdicts agree across ranks]: the search cannot go on
        message = f"{parted}; the search stops at this program"
        raise AssertionError(headline(settings.fuzz_seed, parted.value, message)
                             + "\nthe program it stopped in (not shrunk: the ranks cannot run another):\n"
                             + render_program(parted.value, message)) from None


def failure_text(settings: CaseSettings, result: Search) -> str | None:
    """What a row's failure says of ``result``: the unknown failure, shrunk, with the known findings met before
    it; else the known findings met, the first one's reason first; ``None`` when it met no failure."""
    met = [f"program {m.run}: {m.doc} claims {m.failure}\n    {source(m.value)}" for m in result.met]
    if result.failing is not None:
        message = result.message or ""
        case_text = render_program(result.failing, message)
        shown = (f"reproducer, shrunk for {SEARCH_S:.0f} s (the search's budget) but not to a minimum, after "
                 f"{result.runs} runs:\n{case_text}" if result.cut
                 else found_example(settings.fuzz_shrink, result.runs, case_text))
        text = headline(settings.fuzz_seed, result.failing, message) + "\n" + shown
        return text + "".join(f"\nknown finding met before it, {line}" for line in met)
    if not result.met:
        return None
    first = result.met[0]
    return (headline(settings.fuzz_seed, first.value, first.failure)
            + f"\nonly known findings met, in {len(met)} of {result.runs} programs:\n" + "\n".join(met))


def stateful_row(ctx: RankContext, impl: FSDPAdapter, settings: CaseSettings) -> CaseReport:
    """A ``fuzz/stateful_ws*`` row: the search at the context's world size; raises the row's failure
    (:func:`failure_text`), else reports the programs run and what the adapter left out."""
    result = stateful_fuzz(ctx, impl, settings)
    failure = failure_text(settings, result)
    if failure is not None:
        raise AssertionError(failure)
    missing = missing_operations(impl, ctx.mode)
    dropped = sorted(FEATURES - features_of(impl))
    notes = [f"skipped {op} ({reason})" for op, reason in missing.items()]
    notes += [f"not drawn: {', '.join(dropped)}"] * bool(dropped)
    return CaseReport(
        reason=f"{budget(settings, ctx.world_size)} programs ({result.counted} operations) from seed "
               f"{settings.fuzz_seed}, no mismatch" + "".join(f"; {note}" for note in notes),
        metrics={"programs": result.runs, "operations": result.counted},
    )
