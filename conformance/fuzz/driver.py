"""The fuzz loop: hypothesis on rank 0, every rank running each example it draws.

[Note: hypothesis inside rank processes]
Hypothesis must see one deterministic property. Only rank 0 runs it
(``hypothesis.find`` with a seeded ``Random``, no example database, no
deadline): for each value it draws or tries while shrinking, rank 0 sends the
plain-data value (a parity :class:`~conformance.fuzz.example.Example`, or a
stateful :class:`~conformance.fuzz.ops.Program`) to every rank (an
all-gather of objects in which only rank 0's entry counts), all ranks run it
(:func:`~conformance.fuzz.parity_run.check_example` or
:func:`~conformance.fuzz.stateful.check_program`, whose verdict is the same on
every rank), and rank 0 returns that verdict to hypothesis. :func:`search` is
that loop for any strategy and check; both fuzzers use it. The other ranks
loop on received messages until rank 0 sends ``stop``, which it always does,
even when hypothesis raises. One rank run per world size evaluates the whole
budget, so the harness's per-case cost is paid once.

The budget comes from the run's settings (the case's ``case_settings``:
``--fuzz-examples``/``FSDP_FUZZ_EXAMPLES``, examples drawn per world size,
else :data:`MAIN_JOB_EXAMPLES`; ``--fuzz-seed``/``FSDP_FUZZ_SEED``), so a
nightly job raises it without code changes. With ``--fuzz-verbose``
(``FSDP_FUZZ_VERBOSE=1``) rank 0 prints each example before running it, so a
run that dies (a crash cannot be shrunk) names the example it died in.

[Note: unshrunk failures]
A failure found is shrunk to a smallest failing value before the row reports
it: that is the reproducer a user wants, and it can take minutes (each try
runs a program on every rank). ``--fuzz-shrink 0`` (``FSDP_FUZZ_SHRINK=0``)
reports the first failing value as drawn. The outcome is the same either way,
because shrinking only ever replaces a failure with a smaller failure; the row
says that its example was not shrunk. The mutant sessions
(``conformance/tests/selftest/test_mutants.py``) run so: they ask whether a row FAILs
against a mutant, never what the smallest program is, and the shrinking of
their stateful rows was most of their time.

[Note: shrinking within a budget]
A row must end with a verdict within its timeout, and shrinking a failure at
world size 4 can run hundreds of programs, minutes on a loaded machine. A search
given ``shrink_s`` stops shrinking once that many seconds have passed since it
began, and reports the smallest failing value it has (each value shrinking
keeps is smaller than the one before): the row FAILs with it, and says that it
was not shrunk to the end.

Hypothesis keeps caches (e.g. the constants it collects from local source) in
``.hypothesis/`` under the working directory, which is the user's; it has no
example database to keep here, so :func:`keep_hypothesis_out_of_cwd` points its
storage at the user's cache directory instead (``HYPOTHESIS_STORAGE_DIRECTORY``,
when set, still wins).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hypothesis import Phase, find, settings
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.errors import NoSuchExample
from hypothesis.strategies import SearchStrategy

from conformance.contract.adapter import FSDPAdapter
from conformance.contract.case import CaseSettings
from conformance.contract.optional import takes_param_dtype
from conformance.contract.results import CaseReport
from conformance.fuzz.agreement import RanksParted
from conformance.fuzz.drawn_precision import dtype_of, precision_features, precision_note, required
from conformance.fuzz.example import DTYPES, FUZZ_STRATEGIES, Example, examples, source
from conformance.fuzz.parity_run import check_example
from harness import groups_scope

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["MAIN_JOB_EXAMPLES", "Claim", "FuzzSettings", "FuzzResult", "Met", "Search", "search", "found_example",
           "fuzz", "hypothesis_home", "parity_row",
           "keep_hypothesis_out_of_cwd", "render_case"]

#: Examples per world size in the main job, 30 in all; few at world size 4, where four
#: rank processes share the two cores of a small CI runner (about 1 s per example there,
#: against 0.1-0.3 s at world sizes 1 and 2).
MAIN_JOB_EXAMPLES = {1: 12, 2: 15, 4: 3}


def hypothesis_home() -> Path:
    """Where hypothesis keeps its caches for this suite: ``$XDG_CACHE_HOME`` (else ``~/.cache``), never the cwd."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "fsdp-conformance" / "hypothesis"


def keep_hypothesis_out_of_cwd() -> None:
    """Point hypothesis's storage at :func:`hypothesis_home` unless ``HYPOTHESIS_STORAGE_DIRECTORY`` says where."""
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        set_hypothesis_home_dir(hypothesis_home())


@dataclass(frozen=True)
class FuzzSettings:
    """How many examples to draw per world size (``None``: the main job's), from which seed, whether
    rank 0 prints each one as it starts, and whether a failure found is shrunk ([Note: unshrunk failures])."""

    examples: int | None = None
    seed: int = 0
    verbose: bool = False
    shrink: bool = True

    def __post_init__(self) -> None:
        if self.examples is not None and self.examples < 1:
            raise ValueError(f"fuzz examples must be >= 1, got {self.examples}")

    def budget(self, world_size: int) -> int:
        """Examples to draw at ``world_size``."""
        return self.examples if self.examples is not None else MAIN_JOB_EXAMPLES.get(world_size, 3)

    @classmethod
    def of(cls, settings: CaseSettings) -> FuzzSettings:
        """The fuzz budget of a run's settings."""
        return cls(examples=settings.fuzz_examples, seed=settings.fuzz_seed, verbose=settings.fuzz_verbose,
                   shrink=settings.fuzz_shrink)


@dataclass(frozen=True)
class FuzzResult:
    """What a fuzz run did: examples run (drawn and shrinking tries), how many of them under a
    mixed-precision policy, and the minimal failure if any."""

    runs: int
    failing: Example | None = None
    message: str | None = None
    mixed_precision: int = 0


def _broadcast(ctx: RankContext, message: Any) -> Any:
    """Rank 0's ``message`` on every rank (others pass ``None``)."""
    return ctx.all_gather_object(message if ctx.rank == 0 else None)[0]


#: What runs one drawn value on every rank: ``check(ctx, impl, value)``, the failure text (the same
#: on every rank) or ``None``.
Check = Callable[["RankContext", FSDPAdapter, Any], "str | None"]
#: Which registered finding claims a failing value: ``claim(value, failure)``, the finding's write-up or ``None``
#: ([Note: known findings in a search] in :mod:`conformance.fuzz.searching`).
Claim = Callable[[Any, str], "str | None"]


@dataclass(frozen=True)
class Met:
    """A failing value a registered finding claimed: the finding's write-up, which run met it (from 1), the
    value and its failure text."""

    doc: str
    run: int
    value: Any
    failure: str


@dataclass(frozen=True)
class Search:
    """What one hypothesis search did: values run (drawn and shrinking tries), how many of them
    ``counted`` held for, the minimal failing value with its failure text, if any, and the values registered
    findings claimed before it (or in the whole search, without one)."""

    runs: int
    counted: int = 0
    failing: Any = None
    message: str | None = None
    met: tuple[Met, ...] = ()
    #: shrinking stopped at ``shrink_s`` ([Note: shrinking within a budget]): ``failing`` is the smallest so far
    cut: bool = False


class _ShrinkSpent(BaseException):
    """Shrinking ran past its budget (a ``BaseException``: hypothesis lets it through)."""


def _checked(ctx: RankContext, impl: FSDPAdapter, check: Check, value: Any) -> str | None:
    """``check`` of ``value``, the process groups it made destroyed afterwards ([Note: groups made per example])."""
    with groups_scope():
        return check(ctx, impl, value)


def _follow(ctx: RankContext, impl: FSDPAdapter, check: Check) -> Search:
    while True:
        kind, payload = _broadcast(ctx, None)
        if kind == "stop":
            return payload
        _checked(ctx, impl, check, payload)


def _drive(ctx: RankContext, impl: FSDPAdapter, drawn: SearchStrategy[Any], check: Check, budget: int,
           config: FuzzSettings, counted: Callable[[Any], int], claim: Claim, shrink_s: float | None) -> Search:
    runs = tally = 0
    failures: dict[Any, str] = {}
    met: list[Met] = []
    smallest: list[Any] = []  # the last failure no finding claims: shrinking only ever finds smaller ones
    deadline = None if shrink_s is None else time.monotonic() + shrink_s

    def fails(value: Any) -> bool:
        nonlocal runs, tally
        if smallest and deadline is not None and time.monotonic() > deadline:
            raise _ShrinkSpent
        runs += 1
        tally += counted(value)
        if config.verbose:
            print(f"fuzz example {runs}: {source(value)}", file=sys.stderr, flush=True)
        _broadcast(ctx, ("run", value))
        failure = _checked(ctx, impl, check, value)
        if failure is None:
            return False
        doc = claim(value, failure)
        if doc is None:
            failures[value] = failure
            smallest[:] = [value]
        elif not failures:  # a known finding, met while no other failure was found: recorded, and the search goes on
            met.append(Met(doc, runs, value, failure))
        return doc is None

    phases = (Phase.generate, Phase.shrink) if config.shrink else (Phase.generate,)
    options = settings(max_examples=budget, database=None, deadline=None, phases=phases)
    result: Search | None = None
    parted = False
    keep_hypothesis_out_of_cwd()
    try:
        with _draws_from_the_seed_alone():
            found = find(drawn, fails, settings=options, random=random.Random(config.seed))
        result = Search(runs=runs, counted=tally, failing=found, message=failures[found], met=tuple(met))
    except NoSuchExample:
        result = Search(runs=runs, counted=tally, met=tuple(met))
    except _ShrinkSpent:
        found = smallest[0]
        result = Search(runs=runs, counted=tally, failing=found, message=failures[found], met=tuple(met), cut=True)
    except RanksParted:
        parted = True  # the other ranks wait in the implementation's collectives: no message reaches them
        raise
    finally:
        if not parted:
            _broadcast(ctx, ("stop", result))  # always release the other ranks, even if hypothesis raised
    return result


def search(ctx: RankContext, impl: FSDPAdapter, drawn: SearchStrategy[Any], check: Check, *, budget: int,
           config: FuzzSettings, counted: Callable[[Any], int] = lambda _value: False,
           claim: Claim = lambda _value, _failure: None, shrink_s: float | None = None) -> Search:
    """Draw ``budget`` plain-data values from ``drawn`` on rank 0 (seeded by ``config``), run each on every
    rank with ``check`` and shrink the first failure ``claim`` leaves to no registered finding ([Note: hypothesis
    inside rank processes]), until ``shrink_s`` seconds after the search began, if given ([Note: shrinking
    within a budget]). Collective; every rank returns rank 0's result."""
    with _one_intra_op_thread():
        if ctx.rank == 0:
            return _drive(ctx, impl, drawn, check, budget, config, counted, claim, shrink_s)
        return _follow(ctx, impl, check)


class _NoConstants:
    """Hypothesis's pool of constants collected from local source, empty."""

    def set_for_type(self, _choice_type: str) -> tuple[()]:
        return ()


@contextlib.contextmanager
def _draws_from_the_seed_alone() -> Iterator[None]:
    """Hypothesis without the constants it collects from local modules, while a fuzzer draws.

    [Note: draws from the seed alone]
    Recent hypothesis versions now and then draw a constant found in the source
    of the local modules imported so far, and cache that pool per process. A
    seed's examples then depend on what the drawing process has imported: a rank
    process of the pool that ran another adapter's or a mutant's case draws other
    programs than a fresh one (``fuzz_alone`` saw a mutant's row draw a program
    the reference's row never ran). While a fuzzer draws, that pool is empty (and
    the cache of it cleared), so a seed draws the same examples in every process.
    The hook is private to hypothesis; a version without it has no local constants."""
    from hypothesis.internal.conjecture import providers

    saved = getattr(providers, "_get_local_constants", None), getattr(providers, "CONSTANTS_CACHE", None)
    if None in saved:
        yield
        return
    providers._get_local_constants = lambda: _NoConstants()  # type: ignore[assignment, return-value]
    providers.CONSTANTS_CACHE = type(saved[1])(1024)  # type: ignore[call-arg, misc]
    try:
        yield
    finally:
        providers._get_local_constants, providers.CONSTANTS_CACHE = saved  # type: ignore[assignment]


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny ops on one thread per rank: with several threads per rank process, ranks
    outnumbering the cores spend their time in OpenMP spin-waits (a 3-wide fp32
    convolution took seconds at world size 4 on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fuzz(ctx: RankContext, impl: FSDPAdapter, config: FuzzSettings) -> FuzzResult:
    """Run the parity fuzz loop on every rank (collective); every rank returns rank 0's result."""
    strategies = [s for s in FUZZ_STRATEGIES if impl.supports_strategy(s)]
    dtypes = [d for d in DTYPES if takes_param_dtype(impl, dtype_of(d))]
    drawn = examples(ctx.world_size, strategies, precision_features(impl), dtypes)
    found = search(ctx, impl, drawn, check_example, budget=config.budget(ctx.world_size), config=config,
                   counted=lambda example: example.policy is not None)
    return FuzzResult(runs=found.runs, failing=found.failing, message=found.message, mixed_precision=found.counted)


def found_example(shrunk: bool, runs: int, case_text: str) -> str:
    """A fuzz row's failure text after its first line: the example it reports, named for whether it was
    shrunk ([Note: unshrunk failures]), and ``case_text``, the example as a case to paste."""
    found = "minimal reproducer" if shrunk else "reproducer, the first failing example as drawn (not shrunk)"
    return f"{found} after {runs} runs:\n{case_text}"


def render_case(example: Example, message: str) -> str:
    """A ready-to-paste case that reproduces ``example`` (for ``conformance/cases/test_fuzz.py``);
    under a mixed-precision policy it requires the capabilities the policy needs."""
    digest = hashlib.sha1(repr(example).encode()).hexdigest()[:8]
    found = " ".join(message.split())[:300]
    needs = ", ".join(f"Capability.{cap.name}" for cap in required(example.policy))
    requires = f", requires=[{needs}]" if needs else ""
    return (
        f"# Found by the parity fuzzer: {found}\n"
        "# Name it by the behaviour it pins, fuzz/repro_<behaviour> (docs/ADDING_A_CASE.md): "
        f"repro_{digest} is a placeholder\n"
        f'@case("fuzz/repro_{digest}", clause=("C1", "C2"), world_size={example.world_size}, '
        f'modes=("process",){requires})\n'
        f"def test_repro_{digest}(ctx: RankContext, impl: FSDPAdapter) -> None:\n"
        f"    run_example(ctx, impl, {source(example)})\n"
    )


def parity_row(ctx: RankContext, impl: FSDPAdapter, settings: CaseSettings) -> CaseReport:
    """A ``fuzz/parity_ws*`` row: the examples at the context's world size; raises the first mismatch with its
    reproducer, else reports the examples run and how many drew a mixed-precision policy."""
    config = FuzzSettings.of(settings)
    result = fuzz(ctx, impl, config)
    if result.failing is not None:
        raise AssertionError(
            f"parity fuzzer (seed {config.seed}): {result.message}\n"
            + found_example(config.shrink, result.runs, render_case(result.failing, result.message or ""))
        )
    policies = precision_note(impl) or f"{result.mixed_precision} under a mixed-precision policy"
    return CaseReport(
        reason=f"{config.budget(ctx.world_size)} examples from seed {config.seed} ({policies}), no mismatch",
        metrics={"examples": result.runs, "mixed_precision_examples": result.mixed_precision},
    )
