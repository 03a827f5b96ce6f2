"""Whether this process is a rank: the bottom of the harness's import stack.

A rank process (or a thread host) marks itself once at start-up;
:func:`harness.run` refuses to start ranks from inside one, since nested runs
are not supported. Nothing here imports the rest of the harness.
"""

from __future__ import annotations

__all__ = ["mark_rank_process", "is_rank_process"]

_rank_process = False


def mark_rank_process() -> None:
    """Record that this process runs rank bodies (for the rest of its life)."""
    global _rank_process
    _rank_process = True


def is_rank_process() -> bool:
    return _rank_process
