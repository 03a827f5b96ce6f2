"""The world sizes a case runs at: one exact size, or any size its body is correct at.

[Note: world sizes]
A case declares ``world_size=`` on :func:`conformance.contract.case.case`:

- an ``int`` (``world_size=2``) or :class:`Exact` (``Exact(4, reason="...")``): the case runs at that size
  only. :class:`Exact` says why (a layout of two nodes of two ranks, a size-1 behaviour).
- :class:`Scalable` (``Scalable(default=2, minimum=2)``, :data:`TWO_OR_MORE`): the body reads ``ctx.world_size`` for its
  model, data and expectations, so it is correct at every size the declaration accepts.

Process and thread ranks run a row at its default, or at the run's ``--world-size N``
(``FSDP_WORLD_SIZE``); a launched job runs it at the job's size. A row whose declaration
does not accept the size asked for is skipped with the requirement named
(:func:`decide_world_size`); it never runs at a size it does not declare.

A launched job whose size its declaration does not accept runs the row at the largest
size it accepts that fits on one node (``Exact(1)``'s 1, ``Exact(2)``'s 2 on nodes of
2 ranks or more): node 0's rank spawns its ranks ([Note: rows smaller than the job] in
:mod:`harness.ranks.launched`), and the report says so. A row that fits on no node is
skipped naming the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TWO_OR_MORE", "Exact", "Scalable", "SizeDecision", "WorldSizeNeed", "decide_world_size",
           "world_size_need"]


@dataclass(frozen=True)
class Exact:
    """The case runs at ``size`` ranks only; ``reason`` says why its behaviour is that size."""

    size: int
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"Exact world size must be an int >= 1, got size={self.size!r}")

    @property
    def default(self) -> int:
        return self.size

    def accepts(self, size: int) -> bool:
        return size == self.size

    def requirement(self) -> str:
        """What a run must give, e.g. ``world size 4 (two nodes of two ranks)``."""
        return f"world size {self.size}" + (f" ({self.reason})" if self.reason else "")

    def describe(self) -> str:
        """As ``list`` shows it: ``ws 2``."""
        return f"ws {self.size}"


@dataclass(frozen=True)
class Scalable:
    """The case is correct at every world size ``>= minimum`` that is a multiple of ``multiple_of``;
    process and thread ranks run it at ``default`` unless the run asks for another size."""

    default: int
    minimum: int = 1
    multiple_of: int = 1

    def __post_init__(self) -> None:
        for name in ("default", "minimum", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Scalable world size: {name} must be an int >= 1, got {name}={value!r}")
        if self.minimum > self.default:
            raise ValueError(f"Scalable world size: minimum({self.minimum}) > default({self.default})")
        if self.default % self.multiple_of:
            raise ValueError(f"Scalable world size: default({self.default}) is not a multiple of "
                             f"multiple_of({self.multiple_of})")

    def accepts(self, size: int) -> bool:
        return size >= self.minimum and size % self.multiple_of == 0

    def requirement(self) -> str:
        """What a run must give, e.g. ``a world size that is a multiple of 2 and >= 2``."""
        if self.multiple_of > 1:
            return f"a world size that is a multiple of {self.multiple_of} and >= {self.minimum}"
        return f"a world size >= {self.minimum}"

    def describe(self) -> str:
        """As ``list`` shows it: ``ws >=2``, ``ws >=1 (default 2)``, ``ws >=2, multiple of 2``."""
        text = f"ws >={self.minimum}"
        if self.multiple_of > 1:
            text += f", multiple of {self.multiple_of}"
        return text + (f" (default {self.default})" if self.default != self.minimum else "")


WorldSizeNeed = Exact | Scalable
#: What most cases declare: any world size from 2 (2 by default), as ``list`` shows it ``ws >=2``.
TWO_OR_MORE = Scalable(default=2, minimum=2)


def world_size_need(declared: int | Exact | Scalable) -> WorldSizeNeed:
    """A case's ``world_size=`` as a need: an ``int`` is :class:`Exact`; ValueError naming anything else."""
    if isinstance(declared, (Exact, Scalable)):
        return declared
    if isinstance(declared, int) and not isinstance(declared, bool):
        if declared < 1:
            raise ValueError(f"world_size must be >= 1, got {declared}")
        return Exact(declared)
    raise ValueError(f"world_size must be an int, Exact(...) or Scalable(...), got {declared!r}")


@dataclass(frozen=True)
class SizeDecision:
    """The size a row runs at, or (``size`` ``None``) why it is skipped; ``note``: how a launched job runs a
    row smaller than itself, for the report."""

    size: int | None
    reason: str = ""
    note: str = ""


def _within_node(need: WorldSizeNeed, job: int, node_ranks: int) -> SizeDecision:
    """A launched job of ``job`` ranks, ``node_ranks`` a node, that ``need`` does not accept: the largest size
    it accepts that fits on one node, run there ([Note: world sizes]), else the skip naming the layout."""
    fits = [size for size in range(min(job - 1, node_ranks), 0, -1) if need.accepts(size)]
    if not fits:
        reason = f"needs {need.requirement()}, the launched job has {job}"
        if any(need.accepts(size) for size in range(1, job)):
            reason += f" ({job // node_ranks} node(s) of {node_ranks} rank(s): a smaller row runs within one node)"
        return SizeDecision(None, reason)
    ranks = f"{fits[0]} process rank{'s' * (fits[0] > 1)}"
    return SizeDecision(fits[0], note=f"ran on {ranks} spawned on node 0 (it needs {need.requirement()}; the "
                                      f"launched job has {job}, its other ranks waited)")


def decide_world_size(need: WorldSizeNeed, *, requested: int | None = None, launched_job: int | None = None,
                      node_ranks: int | None = None) -> SizeDecision:
    """The world size a row runs at ([Note: world sizes]).

    ``launched_job``: the size of the launched job this process is a rank of (it is the size asked for), with
    ``node_ranks`` ranks on each node (``None``: one node); else ``requested``: the run's ``--world-size``
    (``None``: the declaration's default).
    """
    if launched_job is not None:
        if not need.accepts(launched_job):
            return _within_node(need, launched_job, launched_job if node_ranks is None else node_ranks)
        return SizeDecision(launched_job)
    if requested is not None:
        if need.accepts(requested):
            return SizeDecision(requested)
        return SizeDecision(None, f"needs {need.requirement()}, the run asks for {requested} (--world-size)")
    return SizeDecision(need.default)
