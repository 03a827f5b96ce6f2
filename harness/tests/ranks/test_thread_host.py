"""How a thread host names the rank behind its death ([Note: thread host])."""

from __future__ import annotations

from harness.ranks.thread_host import _culprit

LOG = "start 0 139871\nstart 1 139999\n"


def test_an_exit_note_names_the_rank() -> None:
    assert _culprit(LOG + "exit 1 3\n", "") == (1, True)


def test_the_crash_dumps_current_thread_names_the_rank() -> None:
    crash = f"Fatal Python error: Segmentation fault\n\nCurrent thread {hex(139999)} (most recent call first):\n"
    assert _culprit(LOG, crash) == (1, True)


def test_without_a_clue_the_lowest_started_rank_is_named_as_unknown() -> None:
    assert _culprit(LOG, "") == (0, False)
    assert _culprit("", "Current thread 0x1234 (most recent call first):") == (0, False)
