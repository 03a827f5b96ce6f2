"""The rank mode: how a case's ranks exist. Defined and resolved here; every layer above uses these values.

[Note: rank modes]
A case runs on ranks that are spawned processes (:attr:`RankMode.PROCESS`),
threads of one host process (:attr:`RankMode.THREAD`), or the processes of a
job some launcher such as ``torchrun`` already started (:attr:`RankMode.LAUNCHED`).
A case declares the modes it can run under among the spawned ones
(:data:`SPAWNED`); a launched job runs every case it is asked to.

A run selects modes once, by name (:data:`SELECTIONS`: a mode, or ``both``
for process then thread), with the project's precedence (command line
``--fsdp-rank-mode`` > :data:`RANK_MODE_ENV` > ini ``fsdp_rank_mode`` > ``both``;
:func:`resolve_selection`). The harness's pytest plugin resolves it once per
session into the config; the conformance runner reads that value and the
``fsdp-conformance`` command forwards the flag untouched. A case whose
declared modes the selection excludes still has its rows: each says so as
its reason (n/a in the conformance matrix), never an empty parameter set.
"""

from __future__ import annotations

import enum

from harness.setting_sources import Resolved, choice, resolve

__all__ = ["RANK_MODE_ENV", "SELECTIONS", "SPAWNED", "RankMode", "excluded_reason", "modes_of", "resolve_selection"]

RANK_MODE_ENV = "FSDP_RANK_MODE"


class RankMode(str, enum.Enum):
    """How the ranks of one case exist (see [Note: rank modes])."""

    PROCESS = "process"
    """One spawned process per rank, from a pool reused across cases (:mod:`harness.ranks.process`)."""
    THREAD = "thread"
    """Threads of a thread host process, on torch's threaded process group (:mod:`harness.ranks.thread_host`)."""
    LAUNCHED = "launched"
    """This process is one rank of a job a launcher started (:mod:`harness.ranks.launched`)."""

    def __str__(self) -> str:
        return self.value


#: The modes a case can declare: the ones the harness starts ranks for.
SPAWNED: tuple[RankMode, ...] = (RankMode.PROCESS, RankMode.THREAD)
#: What a run may select -> the modes it runs, in order.
SELECTIONS: dict[str, tuple[RankMode, ...]] = {"both": SPAWNED, **{mode.value: (mode,) for mode in RankMode}}
DEFAULT_SELECTION = "both"


def resolve_selection(*, cli: str | None, env: str | None, ini: str | None = None,
                      cli_flag: str = "--fsdp-rank-mode") -> Resolved[str]:
    """The selected rank mode(s) by name: ``cli_flag`` > :data:`RANK_MODE_ENV` > ini ``rank_mode`` > ``both``."""
    return resolve("rank mode", [(cli_flag, cli), (RANK_MODE_ENV, env), ("ini fsdp_rank_mode", ini)],
                   choice(tuple(SELECTIONS)), DEFAULT_SELECTION)


def modes_of(selection: str) -> tuple[RankMode, ...]:
    """The modes a selection runs, in order; ValueError naming a selection that is not one."""
    try:
        return SELECTIONS[selection]
    except KeyError:
        raise ValueError(f"rank mode selection {selection!r} is not one of {', '.join(SELECTIONS)}") from None


def excluded_reason(mode: RankMode, declared: tuple[RankMode, ...]) -> str | None:
    """Why a row of a case declaring ``declared`` cannot run under ``mode``, or ``None`` when it can.

    A launched job runs every case (its world size decides, :mod:`harness.ranks.launched`).
    """
    if mode is RankMode.LAUNCHED or mode in declared:
        return None
    return f"declared for {'/'.join(str(m) for m in declared)} ranks only, which excludes {mode} ranks"
