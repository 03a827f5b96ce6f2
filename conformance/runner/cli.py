"""``fsdp-conformance``: run the case matrix, list cases, list implementations.

A thin layer over ``pytest.main`` and the conformance plugin: every option here
maps onto a pytest option and is forwarded as given, so ``pytest conformance/cases
--fsdp-impl X`` gives the same results. The settings are resolved once, by the
plugins inside that session (:mod:`conformance.runner.settings`; the rank mode
by the harness, [Note: rank modes] in :mod:`harness.ranks.rank_mode`), which print
them with their sources; this module decides none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

from conformance.runner import CASES_DIR, PYTEST_PLUGIN, exitcodes
from conformance.runner.options import OPTIONS

# pytest, torch and the adapters are imported by the command that needs them, so --help answers at once.

__all__ = ["main", "CASES_DIR"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-conformance", description=__doc__.splitlines()[0],
                                     epilog=f"run's {exitcodes.HELP}")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of fsdp-conformance, torch and Python, and exit")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the conformance matrix (default: reference, CPU, both rank modes)",
                         epilog=exitcodes.HELP)
    _add_setting_options(run)
    run.add_argument("-k", dest="keyword", metavar="EXPR", help="only cases matching this pytest -k expression")
    run.add_argument("--row", action="append", metavar="ID",
                     help="only this row, an id as 'list', the matrix and the JSON show it; repeatable")
    run.add_argument("--rows-from", metavar="REPORT.json",
                     help="re-run exactly the cells (row, implementation, rank mode) of a previous JSON report "
                     "whose outcome --outcome names")
    run.add_argument("--outcome", metavar="OUTCOMES",
                     help="with --rows-from: the outcomes to re-run, comma-separated (default: FAIL,error)")
    _add_report_options(run)
    run.add_argument("--launcher", choices=("spawn", "torchrun"), default=None,
                     help="deprecated: --launcher torchrun is --rank-mode launched")
    run.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments after --")
    lst = sub.add_parser("list", help="list case rows with their hardware needs and required capabilities")
    lst.add_argument("-k", dest="keyword", metavar="EXPR", help="only cases matching this pytest -k expression")
    lst.add_argument("--impl", metavar="NAME", help="also show which rows are n/a for this adapter, and why")
    lst.add_argument("--explain", metavar="ROW", help="print what one row (an id as the list, the matrix and the "
                     "JSON show it) asserts, with its needs and requirements")
    sub.add_parser("impls", help="list registered implementations and whether they load here")
    return parser


def _add_setting_options(run: argparse.ArgumentParser) -> None:
    """``run``'s options for the run's settings, one per :data:`~conformance.runner.options.OPTIONS` entry
    ([Note: one table of options])."""
    for option in OPTIONS:
        if option.kind == "switch":
            run.add_argument(option.run_flag, dest=option.name, action="store_true", default=None,
                             help=option.help_text())
        else:
            action = "append" if option.kind == "append" else "store"
            run.add_argument(option.run_flag, dest=option.name, action=action, default=None, metavar=option.metavar,
                             help=option.help_text())


def _add_report_options(run: argparse.ArgumentParser) -> None:
    """``run``'s options for the reports it writes and the baseline it compares with."""
    run.add_argument("--expect", metavar="BASELINE.json",
                     help="compare every cell with this JSON report of an earlier run: exit 0 when nothing changed "
                     "(its FAILs are expected), 1 on a new FAIL or error, a changed outcome or reason, or a cell "
                     "that now passes; the differences are shown before the matrix")
    run.add_argument("--json", metavar="PATH", help="write the JSON report (schema: docs/REPORTS.md)")
    run.add_argument("--junitxml", metavar="PATH", help="write JUnit XML, one testcase per row")
    run.add_argument("--markdown", metavar="PATH", help="write the matrix as markdown")
    run.add_argument("--html", metavar="PATH", help="write the matrix as one self-contained HTML page, with filters")


def _quiet_rank() -> bool:
    """A rank other than 0 of a launched job: it runs every case too, but rank 0 alone speaks."""
    return os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ


#: CLI option -> the pytest option it is forwarded as, value untouched, for the options that are not
#: settings (those are forwarded as :data:`~conformance.runner.settings.OPTIONS` says). The CLI's own
#: spellings stay short (``--json``): they cannot collide with a user's pytest options; pytest's are namespaced.
_FORWARDED = {"keyword": "-k", "json": "--conformance-json", "markdown": "--conformance-markdown",
              "html": "--conformance-html", "junitxml": "--conformance-junit", "launcher": "--fsdp-launcher",
              "rows_from": "--fsdp-rows-from", "outcome": "--fsdp-rows-outcome", "expect": "--conformance-expect"}


def _run_args(ns: argparse.Namespace) -> list[str]:
    """The pytest command line for ``ns``: the suite's plugins, each given option forwarded with its value."""
    args = [str(CASES_DIR), "-q", "-p", "no:cacheprovider", "-p", PYTEST_PLUGIN,
            "-W", "ignore::pytest.PytestAssertRewriteWarning", "--conformance-progress"]
    for option in OPTIONS:
        value = getattr(ns, option.name)
        if option.kind == "append":
            args += [part for item in value or () for part in (option.pytest_flag, item)]
        elif option.kind == "switch":
            args += [option.pytest_flag] if value else []
        elif value is not None:
            args += [option.pytest_flag, str(value)]
    for row in ns.row or ():
        args += ["--fsdp-row", row]
    for dest, flag in _FORWARDED.items():
        value = getattr(ns, dest)
        if value is not None:
            args += [flag, str(value)]
    return args + [a for a in ns.pytest_args if a != "--"]


def _run(ns: argparse.Namespace) -> int:
    """Run the session; the exit code is :mod:`conformance.runner.exitcodes`'s."""
    import pytest

    from conformance.runner import signals  # a pytest plugin: imported here, so that --help imports no pytest

    if not _quiet_rank():
        code = int(pytest.main(_run_args(ns)))
    else:
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            code = int(pytest.main(_run_args(ns)))
        if code not in (0, 1):
            print(captured.getvalue()[-4000:], file=sys.stderr)
    if code == int(pytest.ExitCode.NO_TESTS_COLLECTED):
        print("fsdp-conformance: no case matched the selection", file=sys.stderr)
    return exitcodes.from_pytest(code, signals.received())


def _list(ns: argparse.Namespace) -> int:
    from conformance.runner.listing import collect_rows

    try:
        rows = collect_rows(ns.keyword, ns.impl)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return exitcodes.USAGE_ERROR
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    if ns.explain is not None:
        return _explain(ns.explain, rows)
    width = max((len(row.row_id) for row in rows), default=0)
    for row in rows:
        print(f"{row.row_id.ljust(width)}  {row.text()}")
    summary = f"{len(rows)} cases"
    if ns.impl:
        summary += f"; {sum(1 for row in rows if row.not_applicable)} with n/a rank modes for {ns.impl}"
        failing = sum(1 for row in rows if row.errors)
        if failing:
            summary += f"; {failing} that would be errors (the adapter fails to load)"
    print(summary)
    return 0


def _explain(row_id: str, rows: list[Any]) -> int:
    """Print what ``row_id`` asserts; a usage error (exit 2) naming an id no row has."""
    found = [row for row in rows if row.row_id == row_id]
    if not found:
        print(f"fsdp-conformance list --explain: no row {row_id!r}; 'fsdp-conformance list' shows the ids",
              file=sys.stderr)
        return 2
    row = found[0]
    print(f"{row.row_id}\n  {row.text()}\n")
    print("\n".join(f"  {line}" if line else "" for line in row.asserts.splitlines()))
    return 0


def _impls(_: argparse.Namespace) -> int:
    from conformance.contract import registry

    try:
        entries = registry.registered()
    except ValueError as exc:  # a malformed FSDP_CONFORMANCE_ADAPTERS entry, named
        print(f"fsdp-conformance impls: {exc}", file=sys.stderr)
        return exitcodes.USAGE_ERROR
    for name, entry in entries.items():
        status: Any
        try:
            adapter = registry.load(name)
            reason = adapter.unavailable_reason()
            status = "ok" if reason is None else f"unavailable: {reason}"
            caps = ", ".join(sorted(str(c) for c in adapter.capabilities))
        except Exception as exc:  # noqa: BLE001 - report, do not crash the listing
            status, caps = f"import failed: {type(exc).__name__}: {exc}", ""
        print(f"{name:14s} {status}\n    {entry.target}\n    capabilities: {caps or '-'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.version:
        from conformance.runner.versions import version_text

        print(version_text())
        return 0
    if ns.command is None:
        _parser().print_help()
        return 2
    return {"run": _run, "list": _list, "impls": _impls}[ns.command](ns)


if __name__ == "__main__":
    sys.exit(main())
