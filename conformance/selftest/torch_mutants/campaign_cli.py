"""``python -m conformance.selftest.torch_mutants``: the command line of a torch mutant campaign.

Exit codes: 0 the campaign ran (whatever its verdicts), 2 a usage error
naming the bad value, 3 the unmutated baseline run could not be used.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from conformance.selftest.torch_mutants.campaign import BaselineError, draw, run_campaign
from conformance.selftest.torch_mutants.campaign_report import write_reports
from conformance.selftest.torch_mutants.suite_run import Selection
from conformance.selftest.torch_mutants.targets import IMPLS, TargetError, target_modules, target_source

__all__ = ["main", "parser"]

_RANK_MODES = ("process", "thread", "both")


def _positive(kind: type[int] | type[float], option: str) -> Callable[[str], int | float]:
    """An argparse type: ``kind(text)`` when positive, else an error naming ``option`` and ``text``."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"bad {option} {text!r}: a positive {kind.__name__} is needed")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance.selftest.torch_mutants",
        description="Run the suite's rows against a seeded sample of generated mutants of torch's installed FSDP "
                    "sources (docs/TESTING.md: Mutants of torch's FSDP).")
    p.add_argument("--impl", required=True, metavar="|".join(IMPLS), help="whose torch sources to mutate")
    p.add_argument("--sample", type=_positive(int, "--sample"), default=12, metavar="N",
                   help="how many mutants to draw (default 12)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the sample's seed (default 0)")
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="the rows to run, as `conformance run -k`")
    p.add_argument("--rank-mode", choices=_RANK_MODES, default=None, help="as `conformance run --rank-mode`")
    p.add_argument("--timeout-s", type=_positive(float, "--timeout-s"), default=None, metavar="T",
                   help="a mutant run's time limit (default: 3 x the baseline's wall time + 30 s)")
    p.add_argument("--module", action="append", metavar="NAME",
                   help="mutate only this target module (repeatable; default: all of the implementation's)")
    p.add_argument("--out", type=Path, default=Path("torch-mutants"), metavar="DIR",
                   help="an empty or new directory for the runs and reports (default ./torch-mutants)")
    p.add_argument("--list", action="store_true", help="print the drawn mutants' ids and run nothing")
    return p


def _modules(args: argparse.Namespace) -> list[str]:
    modules = target_modules(args.impl)
    for name in args.module or ():
        if name not in modules:
            raise TargetError(f"--module {name!r} is not a target module of {args.impl}: {', '.join(modules)}")
    return args.module or modules


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TargetError(f"--out {str(out)!r} exists and is not an empty directory")


def _facts(started: str) -> dict[str, str]:
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "started_at": started, "ended_at": _now()}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        if not args.list:
            _check_out(args.out)
        sources = {module: target_source(module) for module in _modules(args)}
    except TargetError as error:
        p.error(str(error))
    if args.list:
        population, chosen = draw(sources, args.sample, args.seed)
        print("\n".join(mutant.id for mutant in chosen))
        print(f"{len(chosen)} of {population} mutants (seed {args.seed})")
        return 0
    started, selection = _now(), Selection(args.impl, args.keyword, args.rank_mode)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        campaign = run_campaign(selection, sources, args.sample, args.seed, args.out, args.timeout_s,
                                lambda line: print(line, flush=True))
    except BaselineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    json_path, text_path = write_reports(campaign, _facts(started), args.out)
    print(text_path.read_text(), end="")
    print(f"reports: {json_path}, {text_path}")
    return 0
