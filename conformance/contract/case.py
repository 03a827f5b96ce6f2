"""Declaring a conformance case.

A case is a test function in ``conformance/cases/test_<area>.py``::

    @case("exec_order/train_eval", world_size=2, requires=[Capability.EXEC_ORDER_VALIDATION])
    @pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
    def test_train_eval(ctx: RankContext, impl: FSDPAdapter, strategy: str) -> None:
        ...

The grid is always ``pytest.mark.parametrize``. The body runs on every rank
(the harness's ``ranks`` marker, which :func:`case` adds); ``impl`` is the
adapter under test, parametrized by the conformance plugin. Requirements and
hardware needs are checked in the parent *before* any rank starts:

- a missing capability -> :class:`NotApplicable` ("n/a", capability named);
- missing hardware -> a plain skip ("needs 2 distinct GPUs, found 1");
- a sharding strategy the adapter does not support (a ``strategy`` grid
  parameter, ``strategies=``, or else the default strategy) -> :class:`NotApplicable`,
  strategy named ([Note: a row's strategies]).

[Note: a row's strategies]
Every row that wraps asks the adapter's ``supports_strategy`` for each strategy it
wraps with, before any rank starts. A row declares them as its ``strategy`` grid
parameter and ``strategies=``; a case that declares neither wraps with
:data:`~conformance.contract.adapter.DEFAULT_STRATEGY` (a bare ``WrapSpec()``), so
that is what its rows ask for: the default is a declaration, not an omission.
A body that draws its strategies from those the adapter supports (the fuzzers)
declares them as ``draws_strategies=``: its rows ask for none in particular and are
``n/a`` only when the adapter supports none of them. A wrap with a strategy the row
did not declare and the adapter refuses is an error in the case, never a FAIL of the
adapter (:class:`conformance.contract.declared.DeclaredAdapter`).

A row that computes on a GPU declares what it needs with ``gpus=``:
:data:`ANY_GPU` (ranks may share one GPU, so it also runs on a one-GPU
machine) or ``distinct_gpus(N)`` (e.g. a module spread over two GPUs, or a
device check that expects ``cuda:{rank}``). Rows without ``gpus`` are CPU rows.
Like ``requires``, ``gpus`` may be a function of the row's parameters, so one
body checks one behaviour on CPU and GPU rows alike (a grid parameter
``on=["cpu", "gpu"]`` with ``gpus=gpu_rows``): no twin cases per placement.
The plugin turns the need into a placement with :func:`harness.ranks.devices.decide`
([Note: placements]); the body reads its device from ``ctx.device``.

Every case names the contract clause it asserts with ``clause=`` (one or several): a clause id
of ``docs/CONTRACT.md`` (``"C2"``, the gradient contract) or a
:class:`~conformance.contract.clauses.DocCitation` of the implementation's own documentation
(document, section, torch version). An unknown clause id fails the declaration; ``list --explain``
shows the clause beside what the row asserts.

A case that measures wall time declares ``timing=True``: it gets the
``timing`` marker, so ``-n N`` runs it after every other case, alone
([Note: timing phase] in :mod:`harness.plugin.scheduling`).

None is ever reported as passed. A body may also raise
:class:`NotApplicable` itself (via :func:`not_applicable`) when only the
run-time combination is inexpressible; all ranks must agree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from conformance.contract.adapter import DEFAULT_STRATEGY, STRATEGIES, Capability
from conformance.contract.clauses import ClauseRef, DocCitation, clause_refs
from conformance.contract.world_size import TWO_OR_MORE, Exact, Scalable, WorldSizeNeed, world_size_need
from harness.ranks.devices import ANY_GPU, GpuNeed, distinct_gpus
from harness.ranks.rank_mode import SPAWNED, RankMode

#: What a case (or one of its rows) declares as ``world_size=`` ([Note: world sizes]).
WorldSize = int | Exact | Scalable

__all__ = ["CaseSettings", "CaseSpec", "KnownFailure", "NotApplicable", "case", "not_applicable", "Requires",
           "gpu_rows", "ANY_GPU", "GpuNeed", "distinct_gpus", "DocCitation", "Exact", "Scalable", "TWO_OR_MORE"]

_F = TypeVar("_F", bound=Callable[..., Any])
_ID = re.compile(r"^[a-z0-9_]+/[a-z0-9_]+$")

Requires = Iterable[Capability] | Callable[[Mapping[str, Any]], Iterable[Capability]]
Gpus = GpuNeed | None | Callable[[Mapping[str, Any]], GpuNeed | None]


class NotApplicable(pytest.skip.Exception):  # type: ignore[name-defined,misc]
    """The implementation cannot express this case; reported as ``n/a``, never as passed."""


def not_applicable(reason: str) -> None:
    """Stop the case as not applicable (call on every rank alike)."""
    raise NotApplicable(reason, _use_item_location=True)


@dataclass(frozen=True)
class KnownFailure:
    """A registered finding as a case body sees it: its write-up ``doc``, the regular expression ``reason``
    a failure's reason matches for the finding to claim it (``None``: every failure of the row), and what a
    fuzzer's search leaves out of the values it draws next once it met the finding (``set_aside``: names of
    the fuzzer's configuration features or operations; empty: nothing, the search goes on drawing as before)."""

    doc: str
    reason: str | None = None
    set_aside: tuple[str, ...] = ()

    def claims(self, reason: str) -> bool:
        """Whether this finding explains a failure whose reason is ``reason``."""
        return self.reason is None or re.search(self.reason, reason) is not None


@dataclass(frozen=True)
class CaseSettings:
    """The run's settings a case body may read: its ``case_settings`` fixture (resolved by the runner).

    ``timing_repeats``: how many times a timing case repeats each timed region (the median is used).
    ``fuzz_examples``: examples a fuzzer draws per world size (``None``: the main job's budget);
    ``fuzz_seed``: where it draws them from; ``fuzz_verbose``: print each example as it starts.
    ``fuzz_stateful_examples``: programs the stateful fuzzer draws per world size (``None``: the main job's).
    ``fuzz_shrink``: whether a fuzzer shrinks the failure it found (else it reports the first one as drawn).
    ``known_failures``: the registered findings for this row and implementation, which a search may meet and
    go past ([Note: known findings in a search] in :mod:`conformance.fuzz.known`).
    """

    timing_repeats: int = 3
    fuzz_examples: int | None = None
    fuzz_seed: int = 0
    fuzz_verbose: bool = False
    fuzz_stateful_examples: int | None = None
    fuzz_shrink: bool = True
    known_failures: tuple[KnownFailure, ...] = ()


@dataclass(frozen=True)
class CaseSpec:
    """A case's declaration, validated when the module is imported."""

    id: str
    #: An exact size (``int`` or :class:`Exact`, with its reason) or the sizes the body is correct at
    #: (:class:`Scalable`): [Note: world sizes] in :mod:`conformance.contract.world_size`; or a function of the
    #: row's parameters giving one of those (:meth:`need_for`), where rows of one case differ.
    world_size: WorldSize | Callable[[Mapping[str, Any]], WorldSize] = 2
    modes: tuple[RankMode, ...] = SPAWNED
    requires: Requires = ()
    #: ``None``: a CPU row; else what the row needs (:data:`ANY_GPU`, ``distinct_gpus(N)``);
    #: or a function of the row's parameters giving one of those (:meth:`gpus_for`).
    gpus: Gpus = None
    #: Seconds the ranks may take, or a function of the run's :class:`CaseSettings` (e.g. a fuzz budget).
    timeout_s: float | Callable[[CaseSettings], float] = 120.0
    isolated: bool = False
    env: dict[str, str] = field(default_factory=dict)
    timing: bool = False
    #: Strategies the body wraps with besides a ``strategy`` grid parameter (checked before ranks start);
    #: ``None``: :data:`DEFAULT_STRATEGY` unless the grid has a ``strategy`` ([Note: a row's strategies]).
    strategies: tuple[str | None, ...] | None = None
    #: Strategies the body draws from, using only those the adapter supports (``n/a`` if it supports none).
    draws_strategies: tuple[str, ...] = ()
    #: Capabilities the body exercises only where the adapter declares them (a fuzzer drawing
    #: configurations from what the adapter offers); never a reason for ``n/a``.
    uses: tuple[Capability, ...] = ()
    #: The contract clauses the case asserts: clause ids of ``docs/CONTRACT.md`` or documentation citations.
    clauses: tuple[ClauseRef, ...] = ()

    def __post_init__(self) -> None:
        clause_refs(self.id, self.clauses)  # an unknown clause id fails at import
        if not _ID.match(self.id):
            raise ValueError(f"case id {self.id!r} must look like 'area/name' (lowercase, digits, _)")
        if not callable(self.world_size):
            self.need_for({})
        bad = [m for m in self.modes if m not in SPAWNED]
        if bad or not self.modes:
            raise ValueError(f"case {self.id}: modes must be a non-empty subset of "
                             f"{tuple(str(m) for m in SPAWNED)}, got {self.modes}")
        if not callable(self.gpus):
            self.gpus_for({})
        self.timeout(CaseSettings())  # a bad value (or function) fails at import
        unknown = [s for s in (*(self.strategies or ()), *self.draws_strategies) if s not in (*STRATEGIES, None)]
        if unknown:
            raise ValueError(f"case {self.id}: strategies {unknown} not in {STRATEGIES} (or None, the default)")

    def timeout(self, settings: CaseSettings) -> float:
        """Seconds this case's ranks may take under ``settings``; ValueError naming a non-positive one."""
        value = self.timeout_s(settings) if callable(self.timeout_s) else self.timeout_s
        if not value > 0:
            raise ValueError(f"case {self.id}: timeout_s must be > 0, got {value!r}")
        return float(value)

    @property
    def need(self) -> WorldSizeNeed:
        """The world sizes every row of this case runs at ([Note: world sizes]); ValueError for a case that
        declares them per row (:meth:`need_for`)."""
        if callable(self.world_size):
            raise ValueError(f"case {self.id} declares its world sizes per row; ask need_for(params)")
        return self.need_for({})

    def need_for(self, params: Mapping[str, Any]) -> WorldSizeNeed:
        """The world sizes the row with ``params`` runs at; ValueError naming a bad declaration."""
        declared = self.world_size(params) if callable(self.world_size) else self.world_size
        try:
            return world_size_need(declared)
        except ValueError as exc:
            raise ValueError(f"case {self.id}: {exc}") from None

    @property
    def area(self) -> str:
        return self.id.split("/", 1)[0]

    def permitted(self, params: Mapping[str, Any], declared: Iterable[Capability]) -> list[Capability]:
        """What a wrap in this row may ask of an adapter that declares ``declared``:
        :meth:`required` and the :attr:`uses` it declares ([Note: requirements are checked once])."""
        declared = set(declared)
        return self.required(params) + [c for c in self.uses if c in declared]

    def required(self, params: Mapping[str, Any]) -> list[Capability]:
        """The capabilities this grid point needs (``params`` includes ``rank_mode``).

        Thread ranks add :attr:`Capability.THREAD_RANKS` to what the case declares.
        """
        caps = list(self.requires(params) if callable(self.requires) else self.requires)
        if params.get("rank_mode") == RankMode.THREAD and Capability.THREAD_RANKS not in caps:
            caps.append(Capability.THREAD_RANKS)
        return caps

    def gpus_for(self, params: Mapping[str, Any]) -> GpuNeed | None:
        """What this row needs of GPUs (``None``: a CPU row); ValueError naming a bad declaration."""
        need = self.gpus(params) if callable(self.gpus) else self.gpus
        if need is not None and not isinstance(need, GpuNeed):
            raise ValueError(f"case {self.id}: gpus must be None, ANY_GPU or distinct_gpus(N), got {need!r}")
        return need

    def strategies_for(self, params: Mapping[str, Any]) -> list[str | None]:
        """The sharding strategies this grid point wraps with: the declared ones and a ``strategy``
        parameter, or :data:`DEFAULT_STRATEGY` for a case that declares neither ([Note: a row's strategies])."""
        declared = self.strategies
        if declared is None:
            declared = () if "strategy" in params or self.draws_strategies else (DEFAULT_STRATEGY,)
        out: list[str | None] = list(declared)
        if "strategy" in params and params["strategy"] not in out:
            out.append(params["strategy"])
        return out

    def needs_text(self, params: Mapping[str, Any]) -> str:
        """The row's hardware needs as ``list`` shows them."""
        need = self.gpus_for(params)
        return f"{'cpu' if need is None else need.describe()}, {self.need_for(params).describe()}"


def case(
    case_id: str,
    *,
    world_size: WorldSize | Callable[[Mapping[str, Any]], WorldSize] = 2,
    modes: Iterable[RankMode | str] = SPAWNED,
    requires: Requires = (),
    gpus: Gpus = None,
    timeout_s: float | Callable[[CaseSettings], float] = 120.0,
    isolated: bool = False,
    env: Mapping[str, str] | None = None,
    timing: bool = False,
    strategies: Iterable[str | None] | None = None,
    draws_strategies: Iterable[str] = (),
    uses: Iterable[Capability] = (),
    clause: ClauseRef | Iterable[ClauseRef] | None = None,
) -> Callable[[_F], _F]:
    """Declare a conformance case (see the module docstring).

    ``strategies``: sharding strategies the body uses that are not a ``strategy``
    grid parameter; an adapter whose ``supports_strategy`` refuses one makes the row ``n/a``.
    Left out, a case without a ``strategy`` grid parameter wraps with the default strategy
    ([Note: a row's strategies]); ``()`` says the body never calls ``wrap``.
    ``draws_strategies``: strategies the body picks from, only among those the adapter supports.
    ``uses``: capabilities the body exercises only when the adapter declares them.
    ``world_size``: an exact size (``2``, ``Exact(4, reason=...)``), ``Scalable(default=2, minimum=2)`` (the sizes the
    body is correct at), or a function of the row's parameters giving one of those ([Note: world sizes]).
    ``clause``: the contract clause(s) the case asserts: ids of ``docs/CONTRACT.md`` or
    :class:`DocCitation` values; an unknown id is a ValueError.
    """
    spec = CaseSpec(
        id=case_id,
        world_size=world_size,
        modes=tuple(_rank_mode(case_id, m) for m in modes),
        requires=requires if callable(requires) else tuple(requires),
        gpus=gpus,
        timeout_s=timeout_s,
        isolated=isolated,
        env=dict(env or {}),
        timing=timing,
        strategies=None if strategies is None else tuple(strategies),
        draws_strategies=tuple(draws_strategies),
        uses=tuple(uses),
        clauses=clause_refs(case_id, clause),
    )

    def decorate(fn: _F) -> _F:
        fn = pytest.mark.conformance(spec)(fn)
        if spec.gpus is not None and not callable(spec.gpus):
            fn = pytest.mark.gpu(fn)  # selected by `tox -e gpu` (-m gpu); per row for a function of the grid
        if spec.timing:
            fn = pytest.mark.timing(fn)
        return pytest.mark.ranks(
            world_size=2 if callable(spec.world_size) else spec.need.default,  # the plugin answers per row
            modes=spec.modes,
            timeout_s=spec.timeout(CaseSettings()),  # the conformance plugin answers with the run's settings
            isolated=spec.isolated,
            env=spec.env or None,
        )(fn)

    return decorate


def gpu_rows(params: Mapping[str, Any]) -> GpuNeed | None:
    """``gpus=`` for a case with the grid parameter ``on`` (``"cpu"`` or ``"gpu"``): its ``gpu`` rows
    need :data:`ANY_GPU`, its ``cpu`` rows are CPU rows."""
    on = params.get("on")
    if on not in ("cpu", "gpu"):
        raise ValueError(f"gpus=gpu_rows needs a grid parameter on='cpu'|'gpu', got on={on!r}")
    return ANY_GPU if on == "gpu" else None


def _rank_mode(case_id: str, mode: RankMode | str) -> RankMode:
    try:
        return RankMode(mode)
    except ValueError:
        raise ValueError(f"case {case_id}: {mode!r} is not a rank mode; expected one of "
                         f"{tuple(str(m) for m in SPAWNED)}") from None
