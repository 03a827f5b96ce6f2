"""``fsdp-conformance``: run the case matrix, list cases, list implementations.

A thin layer over ``pytest.main`` and the conformance plugin: every option here
maps onto a pytest option, so ``pytest conformance/cases --fsdp-impl X`` gives
the same results. Settings are resolved by
:func:`conformance.runner.settings.resolve_settings`, as in the plugin (environment
variables such as ``FSDP_RANK_MODE`` apply to ``run`` too), printed with their
sources, and passed to pytest explicitly.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

import pytest

from conformance.contract import registry
from conformance.runner.listing import CASES_DIR, collect_rows
from conformance.runner.settings import SettingError, Settings, resolve_settings

__all__ = ["main", "CASES_DIR"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-conformance", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the conformance matrix (default: reference, CPU, both rank modes)")
    run.add_argument("--impl", action="append", metavar="NAME",
                     help="adapter name, repeatable; 'all' for every one (default: $FSDP_CONFORMANCE_IMPL "
                     "or reference)")
    run.add_argument("--rank-mode", choices=("process", "thread", "both"), default=None,
                     help="default: $FSDP_RANK_MODE or both")
    run.add_argument("-k", dest="keyword", metavar="EXPR", help="only cases matching this pytest -k expression")
    run.add_argument("--json", metavar="PATH", help="write results as JSON")
    run.add_argument("--junitxml", metavar="PATH", help="write JUnit XML")
    run.add_argument("--markdown", metavar="PATH", help="write the matrix as markdown")
    run.add_argument("--timing-repeats", type=int, default=None, metavar="N")
    run.add_argument("-n", dest="workers", default=None, metavar="auto|N",
                     help="run cases on N pytest-xdist workers, timing cases alone at the end; auto fits N "
                     "to the cores (default: 0, one process)")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                     help="where rows compute (README: Devices and placements); default $FSDP_DEVICE or auto")
    run.add_argument(
        "--launcher",
        choices=("spawn", "torchrun"),
        default="spawn",
        help="spawn: the harness starts ranks; torchrun: this process is already one rank of a job",
    )
    run.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments after --")
    lst = sub.add_parser("list", help="list case rows with their hardware needs and required capabilities")
    lst.add_argument("-k", dest="keyword", metavar="EXPR")
    lst.add_argument("--impl", metavar="NAME", help="also show which rows are n/a for this adapter, and why")
    sub.add_parser("impls", help="list registered implementations and whether they load here")
    return parser


def _reporting_rank(ns: argparse.Namespace) -> bool:
    """Under torchrun every rank runs the session; only rank 0 prints and writes reports."""
    return ns.launcher != "torchrun" or os.environ.get("RANK", "0") == "0"


def _settings(ns: argparse.Namespace) -> Settings:
    return resolve_settings({
        "impls": ("--impl", ns.impl),
        "rank_mode": ("--rank-mode", ns.rank_mode),
        "timing_repeats": ("--timing-repeats", ns.timing_repeats),
        "workers": ("-n", ns.workers),
        "device": ("--device", ns.device),
    })


def _run_args(ns: argparse.Namespace, settings: Settings) -> list[str]:
    args = [str(CASES_DIR), "-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if not _reporting_rank(ns):
        ns.json = ns.markdown = ns.junitxml = None
    else:
        args.append("--conformance-progress")
    for name in settings.impls.value:
        args += ["--fsdp-impl", name]
    args += ["--rank-mode", settings.rank_mode.value, "--timing-repeats", str(settings.timing_repeats.value),
             "--device", settings.device.value]
    if ns.keyword:
        args += ["-k", ns.keyword]
    if ns.json:
        args += ["--conformance-json", ns.json]
    if ns.markdown:
        args += ["--conformance-markdown", ns.markdown]
    if ns.junitxml:
        args += ["--junitxml", ns.junitxml]
    if ns.launcher == "torchrun":
        args += ["--launcher", "torchrun"]
    if settings.workers.value != 0:
        args += ["-n", str(settings.workers.value)]
    extra = [a for a in ns.pytest_args if a != "--"]
    return args + extra


def _run(ns: argparse.Namespace) -> int:
    try:
        settings = _settings(ns)
    except SettingError as exc:
        print(f"fsdp-conformance: {exc}", file=sys.stderr)
        return 2
    if ns.launcher == "torchrun" and settings.workers.value != 0:
        print(f"fsdp-conformance: -n {settings.workers.value} with --launcher torchrun: a torchrun job's ranks "
              "run every case in lockstep; leave -n out", file=sys.stderr)
        return 2
    if _reporting_rank(ns):
        print(f"fsdp-conformance: {settings.describe()}", flush=True)
        code = int(pytest.main(_run_args(ns, settings)))
    else:
        # Every rank computes the same outcomes (they are exchanged per case); only
        # rank 0 prints them. Other ranks stay quiet unless the session itself breaks.
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            code = int(pytest.main(_run_args(ns, settings)))
        if code not in (0, 1):
            print(captured.getvalue()[-4000:], file=sys.stderr)
    if code == int(pytest.ExitCode.NO_TESTS_COLLECTED):
        print("fsdp-conformance: no case matched the selection", file=sys.stderr)
    return code


def _list(ns: argparse.Namespace) -> int:
    try:
        rows = collect_rows(ns.keyword, ns.impl)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    width = max((len(row.row_id) for row in rows), default=0)
    for row in rows:
        print(f"{row.row_id.ljust(width)}  {row.text()}")
    summary = f"{len(rows)} cases"
    if ns.impl:
        summary += f"; {sum(1 for row in rows if row.not_applicable)} with n/a rank modes for {ns.impl}"
    print(summary)
    return 0


def _impls(_: argparse.Namespace) -> int:
    for name, entry in registry.registered().items():
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
    if ns.command is None:
        _parser().print_help()
        return 2
    return {"run": _run, "list": _list, "impls": _impls}[ns.command](ns)


if __name__ == "__main__":
    sys.exit(main())
