"""The exit codes of ``fsdp-conformance run`` (docs/USAGE.md: Exit codes; ``--help`` prints :data:`HELP`)."""

from __future__ import annotations

__all__ = ["FAIL", "HELP", "INTERNAL_ERROR", "INTERRUPTED", "NO_ROWS", "PASS", "USAGE_ERROR", "from_pytest"]

#: Every selected row ran and none is FAIL or error (n/a and skip are allowed); with a baseline
#: (``--expect``), every cell is as the baseline has it, its FAILs included.
PASS = 0
#: At least one row is FAIL or error; with a baseline, a cell changed (a new FAIL or error, a changed outcome
#: or reason, a cell that now passes) or the run did not reach every selected row.
FAIL = 1
#: A bad option, setting (an ``FSDP_*`` variable, an adapter entry, a findings file) or report path; nothing ran.
USAGE_ERROR = 2
#: The runner itself failed (pytest's internal error, a case module that does not import, a report not written).
INTERNAL_ERROR = 3
#: SIGTERM, SIGINT or SIGHUP stopped the run; the reports were written, marked interrupted.
INTERRUPTED = 4
#: No case matched the selection.
NO_ROWS = 5

HELP = (f"exit codes: {PASS} every row ran, none FAIL or error (with --expect: no cell changed); {FAIL} a row is "
        f"FAIL or error (with --expect: a cell changed); {USAGE_ERROR} usage error (bad option, setting, baseline or "
        f"report path; nothing ran); {INTERNAL_ERROR} internal error; {INTERRUPTED} interrupted by SIGTERM, "
        f"SIGINT or SIGHUP (reports written, marked interrupted); {NO_ROWS} no case matched")


def from_pytest(code: int, stopped_by: str | None) -> int:
    """This command's exit code for pytest's ``code``, given the stop signal the run received (if any)."""
    import pytest  # not at import: ``--help`` prints HELP without loading pytest

    if stopped_by is not None:
        return INTERRUPTED
    return {int(pytest.ExitCode.OK): PASS, int(pytest.ExitCode.TESTS_FAILED): FAIL,
            int(pytest.ExitCode.USAGE_ERROR): USAGE_ERROR,
            int(pytest.ExitCode.NO_TESTS_COLLECTED): NO_ROWS}.get(code, INTERNAL_ERROR)
