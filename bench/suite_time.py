"""Wall time of ``fsdp-conformance run`` per implementation and rank mode, and the slowest cases.

Each configuration is a fresh ``python -m conformance run`` subprocess (as a
user would run it), so interpreter start, imports and pool start-up are
included. The slowest cases come from the run's own ``--json`` durations.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import base_parser, print_table, write_json

__all__ = ["time_run"]


def time_run(impl: str, rank_mode: str, extra: list[str]) -> dict[str, Any]:
    """Run the suite once; wall time, exit code, outcome counts and per-case durations."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "conformance", "run", "--impl", impl, "--rank-mode", rank_mode,
               "--json", str(out), *extra]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        results = json.loads(out.read_text()) if out.exists() else []
    counts: dict[str, int] = {}
    for row in results:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    return {"impl": impl, "rank_mode": rank_mode, "wall_s": wall, "exit_code": proc.returncode,
            "counts": counts, "results": results,
            "tail": proc.stdout.splitlines()[-1:] if proc.stdout else proc.stderr.splitlines()[-3:]}


def main() -> None:
    parser = base_parser("suite_time", __doc__)
    parser.add_argument("--impl", action="append", default=None, help="default: reference")
    parser.add_argument("--rank-mode", action="append", default=None, choices=("process", "thread", "both"),
                        help="default: both (one run), then each mode separately with --split")
    parser.add_argument("-k", dest="keyword", default=None)
    parser.add_argument("--slowest", type=int, default=10)
    args = parser.parse_args()
    extra = ["-k", args.keyword] if args.keyword else []
    runs = [time_run(impl, mode, extra) for impl in args.impl or ["reference"] for mode in args.rank_mode or ["both"]]
    print_table(
        ["impl", "rank mode", "wall s", "exit", "outcomes"],
        [[r["impl"], r["rank_mode"], r["wall_s"], r["exit_code"],
          ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items()))] for r in runs],
    )
    cases = sorted((c for r in runs for c in r["results"]), key=lambda c: -c["duration_s"])[: args.slowest]
    print(f"\nslowest {len(cases)} cases")
    print_table(["case", "impl", "mode", "s"], [[c["case"], c["impl"], c["rank_mode"], c["duration_s"]] for c in cases])
    write_json(args.json, {"runs": [{k: v for k, v in r.items() if k != "results"} for r in runs],
                           "slowest": cases})
    if any(r["exit_code"] != 0 for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
