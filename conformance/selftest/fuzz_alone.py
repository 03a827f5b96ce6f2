"""Which mutants the stateful fuzzer catches on its own, without the cases written for them.

``python -m conformance.selftest.fuzz_alone [--examples N] [--seed S] [--rows ws1,ws2] [--mutants a,b]
[--json PATH]`` runs the ``fuzz/stateful_*`` rows (process ranks) against every mutant that runs
on this machine (or the named ones), in one pytest session (a mutant's patches last one case, so
mutants can share a session: see :mod:`conformance.selftest.declare`), and
prints, per mutant, whether a row FAILed, then the count caught/total. Mutants
needing GPUs are counted as not run where none is visible. The unmutated
reference runs the same rows with the same programs in the same session: a row it FAILs
cannot tell a mutant from the reference, so a FAIL there counts as nothing
(the mutant is "not measurable" by that row) and the row is named with the
reference's reason. This is a
measurement, not a test: a mutant the fuzzer misses is a gap to know about, not
an error (each mutant's own cases are required to catch it by
``conformance/tests/selftest/test_mutants.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, cast

from conformance.contract.registry import BUILTIN
from conformance.selftest.declare import Expect
from conformance.selftest.mutants import MUTANTS
from conformance.selftest.session import run_session
from harness.ranks import devices

__all__ = ["main", "runnable_mutants", "verdicts"]

_CASES = Path(__file__).resolve().parents[1] / "cases" / "test_fuzz.py"
CONTROL = "reference"  # the unmutated implementation the mutants are measured against


def runnable_mutants() -> list[str]:
    """Mutants whose breakage this machine can run (their expected rows need no missing GPU)."""
    needs = {name: cast(Any, cls).expect.accelerators for name, cls in MUTANTS.items()}
    return sorted(name for name, gpus in needs.items() if gpus <= devices.visible_gpus())


def verdicts(rows: list[dict[str, object]], mutants: list[str],
             unusable: frozenset[str] = frozenset()) -> dict[str, str]:
    """Each mutant -> ``caught by <row>`` or why not (``missed``: every usable row passed).

    ``unusable``: rows the unmutated reference FAILs; a FAIL there shows nothing about the mutant."""
    out = {}
    for name in mutants:
        mine = [row for row in rows if row["impl"] == name]
        usable = [row for row in mine if row["case"] not in unusable]
        failed = [str(row["case"]) for row in usable if row["outcome"] == "FAIL"]
        if failed:
            out[name] = f"caught by {', '.join(failed)}"
        elif not mine:
            out[name] = "not run (no row)"
        elif not usable:
            out[name] = "not measurable: every row fails on the unmutated reference"
        else:
            out[name] = "missed: " + ", ".join(f"{row['case']} {row['outcome']}" for row in usable)
    return out


def _session(mutants: list[str], args: argparse.Namespace, report: Path) -> list[dict[str, object]]:
    """The stateful rows of every mutant and of the unmutated reference, in one pytest session."""
    rows = [f"stateful_{row}" for row in args.rows.split(",")]
    expect = Expect(" or ".join(rows), "process", tuple(f"fuzz/{row}" for row in rows))
    options = ["--fsdp-fuzz-stateful-examples", str(args.examples), "--fsdp-fuzz-seed", str(args.seed)]
    adapters = {name: f"conformance.selftest.mutants:{MUTANTS[name].__name__}" for name in mutants}
    adapters[CONTROL] = BUILTIN[CONTROL]
    return run_session(adapters, dict.fromkeys(adapters, expect), report=report, files=[str(_CASES)],
                       options=options, timeout_s=24 * 3600)


def reference_failures(rows: list[dict[str, object]]) -> dict[str, str]:
    """The rows the unmutated reference did not pass on the same programs, with its reasons."""
    return {str(row["case"]): str(row["reason"]) for row in rows
            if row["impl"] == CONTROL and row["outcome"] != "pass"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--examples", type=int, default=20, help="programs per row (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="the fuzz seed (default 0)")
    parser.add_argument("--rows", default="ws1,ws2", help="world-size rows to run, e.g. ws1,ws2,ws4 (default ws1,ws2)")
    parser.add_argument("--mutants", help="comma-separated mutant names to measure (default: every runnable one)")
    parser.add_argument("--json", type=Path, help="also write mutant -> verdict as JSON here")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be >= 1, got {args.examples}")
    chosen = set(args.mutants.split(",")) if args.mutants else set(MUTANTS)
    unknown = sorted(chosen - set(MUTANTS))
    if unknown:
        parser.error(f"unknown mutants {unknown}")
    mutants = [name for name in runnable_mutants() if name in chosen]
    with tempfile.TemporaryDirectory() as tmp:
        rows = _session(mutants, args, Path(tmp) / "rows.json")
    failing = reference_failures(rows)
    for case, reason in failing.items():
        print(f"{case} does not pass on the unmutated reference, so it measures nothing: {reason}")
    found = verdicts(rows, mutants, frozenset(failing))
    for name, verdict in found.items():
        print(f"{name}: {verdict}")
    caught = sum(verdict.startswith("caught") for verdict in found.values())
    print(f"caught by the stateful fuzzer alone: {caught}/{len(chosen)} mutants "
          f"({len(chosen) - len(mutants)} need GPUs and did not run; {args.examples} programs per row, "
          f"rows {args.rows}, seed {args.seed}"
          + (f"; not counting {', '.join(sorted(failing))}, which the reference fails" if failing else "") + ")")
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
