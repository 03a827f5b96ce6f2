"""Wall time of ``fsdp-conformance run``, serial vs ``-n N``, side by side; the critical path.

Each run is a fresh ``python -m conformance run`` subprocess (as a user runs
it), so interpreter start, imports, xdist's workers and pool start-up are
included. For every job (the main job: reference, both rank modes; and
``--impl all``) the serial run and the parallel run alternate (the order
flips each round) so both see the same machine load; the table shows the
median wall time per mode and the ratio parallel / serial. Both runs must
produce the same rows (ids, outcomes, order) and exit codes (``--impl all``
has FAIL rows, the findings, so its runs exit 1); the script says so or exits 1.

Critical path: timing cases run one after another, alone, at the end of a
parallel run ([Note: timing phase] in ``harness/plugin/scheduling.py``), so a
parallel run cannot take less than their summed time plus the longest other
case; the slowest cases are listed from the runs' own ``--json`` durations.

CPU: every run loads :mod:`bench.cpu_probe` ([Note: CPU per row]), so the
report adds CPU-seconds per area and per case (from the last parallel run;
``--compare`` puts an earlier report's numbers beside them: before/after), and
counts the baseline cache's lookups ([Note: baseline cache] in
``fixtures/baselines.py``): the hit rate is hits / lookups over the run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench import cpu_probe
from bench._common import base_parser, median, print_table, warn_without_bytecode_cache, write_json
from conformance.runner.document import load_report

__all__ = ["cpu_by", "hit_rate", "time_run", "timing_rows"]

JOBS = {"main": ["--impl", "reference"], "all": ["--impl", "all"]}


def time_run(job_args: list[str], workers: str, extra: list[str]) -> dict[str, Any]:
    """Run the suite once; wall time, exit code, outcome counts and per-row results."""
    with tempfile.TemporaryDirectory() as tmp:
        out, cpu_log, cache_log = Path(tmp) / "results.json", Path(tmp) / "cpu", Path(tmp) / "cache"
        cmd = [sys.executable, "-m", "conformance", "run", *job_args, "-n", workers, "--json", str(out), *extra,
               "--", "-p", "bench.cpu_probe"]
        env = {**os.environ, cpu_probe.ENV_VAR: str(cpu_log), "FSDP_BASELINE_CACHE_LOG": str(cache_log)}
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        wall = time.perf_counter() - start
        results = [asdict(r) for r in load_report(out).rows] if out.exists() else []
        cpu = [json.loads(line) for line in cpu_log.read_text().splitlines()] if cpu_log.exists() else []
        lookups = Counter(line.split()[-1] for line in cache_log.read_text().splitlines()) \
            if cache_log.exists() else Counter()
    counts: dict[str, int] = {}
    for row in results:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    return {"workers": workers, "wall_s": wall, "exit_code": proc.returncode, "counts": counts,
            "results": results, "tail": (proc.stdout + proc.stderr).splitlines()[-3:], "cpu": cpu,
            "cache": {"hits": lookups["hit"], "misses": lookups["miss"]}}


class _TimingRows:
    """Collects the row ids of timing cases during a collect-only session."""

    def __init__(self) -> None:
        self.rows: set[str] = set()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        from conformance.contract.rows import case_row_id
        from harness.plugin.workers import is_timing

        self.rows |= {case_row_id(item) for item in session.items if is_timing(item)}


def timing_rows() -> set[str]:
    """Row ids of the cases declared ``timing=True`` (collected in-process, nothing runs)."""
    from conformance.runner import CASES_DIR, PYTEST_PLUGIN

    collector = _TimingRows()
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main([str(CASES_DIR), "--collect-only", "-qq", "-p", "no:cacheprovider", "-p", PYTEST_PLUGIN,
                     "--fsdp-impl", "all"], plugins=[collector])
    return collector.rows


def _key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return row["case"], row["impl"], row["rank_mode"], row["outcome"]


def _critical_path(results: list[dict[str, Any]], timing: set[str], slowest: int) -> dict[str, Any]:
    timed = [r for r in results if r["case"] in timing]
    others = sorted((r for r in results if r["case"] not in timing), key=lambda r: -r["duration_s"])
    return {
        "timing_phase_s": sum(r["duration_s"] for r in timed),
        "other_case_s": sum(r["duration_s"] for r in others),
        "longest_other": others[0] if others else None,
        "slowest": sorted(results, key=lambda r: -r["duration_s"])[:slowest],
    }


def _measure(jobs: list[str], workers: str, rounds: int, extra: list[str],
             parallel_first: bool) -> dict[str, dict[str, list[Any]]]:
    runs: dict[str, dict[str, list[Any]]] = {job: {"0": [], workers: []} for job in jobs}
    for i in range(rounds):
        for job in jobs:
            order = [workers, "0"] if (i % 2 == 0) == parallel_first else ["0", workers]
            for mode in order:
                run = time_run(JOBS[job], mode, extra)
                print(f"round {i + 1} {job:4s} -n {mode:4s} {run['wall_s']:7.1f} s  exit {run['exit_code']}",
                      flush=True)
                runs[job][mode].append(run)
    return runs


def cpu_by(rows: list[dict[str, Any]], level: str) -> dict[str, float]:
    """CPU-seconds summed per area (``level="area"``) or per case (``"case"``: the row id without its
    parameters), largest first."""
    totals: Counter[str] = Counter()
    for row in rows:
        name = row["case"].split("[")[0]
        totals[name.split("/")[0] if level == "area" else name] += row["cpu_s"]
    return {name: round(cpu, 2) for name, cpu in totals.most_common()}


def hit_rate(cache: dict[str, int]) -> float | None:
    lookups = cache["hits"] + cache["misses"]
    return round(cache["hits"] / lookups, 3) if lookups else None


def _print_cpu(entry: dict[str, Any], before: dict[str, Any] | None, slowest: int) -> None:
    """CPU-seconds per area and for the costliest cases, beside an earlier report's (``--compare``)."""
    cache = entry["cache"]
    print(f"\n{entry['job']}: {entry['cpu_s']:.1f} CPU-s in rows; baseline cache {cache['hits']} hits / "
          f"{cache['hits'] + cache['misses']} lookups (hit rate {cache['hit_rate']})"
          + (f"; before: {before['cpu_s']:.1f} CPU-s, hit rate {before['cache']['hit_rate']}" if before else ""))
    for level, limit in (("area", None), ("case", slowest)):
        now = entry[f"cpu_by_{level}"]
        was = before.get(f"cpu_by_{level}", {}) if before else {}
        names = list(now)[:limit] if limit else list(now)
        print_table([level, "CPU-s", *(["before", "after/before"] if before else [])],
                    [[n, now[n], *([was.get(n, "-"), now[n] / was[n] if was.get(n) else "-"] if before else [])]
                     for n in names])


def _report(runs: dict[str, dict[str, list[Any]]], workers: str, slowest: int) -> tuple[list[Any], bool]:
    timing = timing_rows()
    table: list[list[Any]] = []
    summary: list[dict[str, Any]] = []
    ok = True
    for job, by_mode in runs.items():
        serial, parallel = by_mode["0"], by_mode[workers]
        same = all([_key(r) for r in s["results"]] == [_key(r) for r in p["results"]]
                   for s, p in zip(serial, parallel, strict=True))
        same = same and len({r["exit_code"] for r in serial + parallel}) == 1
        ok = ok and same
        s_wall, p_wall = median([r["wall_s"] for r in serial]), median([r["wall_s"] for r in parallel])
        table.append([job, len(serial[0]["results"]), s_wall, p_wall, p_wall / s_wall, "yes" if same else "NO",
                      ", ".join(f"{n} {k}" for k, n in sorted(parallel[0]["counts"].items()))])
        path = _critical_path(parallel[-1]["results"], timing, slowest)
        timed = [{"run": f"-n {mode}", **{k: r[k] for k in ("case", "impl", "outcome", "reason")}}
                 for mode, rs in (("0", serial), (workers, parallel)) for r in rs[-1]["results"] if r["case"] in timing]
        last = parallel[-1]
        summary.append({"job": job, "serial_s": s_wall, "parallel_s": p_wall, "ratio": p_wall / s_wall,
                        "rows_identical": same, "critical_path": path, "timing_rows": timed,
                        "cpu_s": round(sum(r["cpu_s"] for r in last["cpu"]), 2),
                        "cpu_by_area": cpu_by(last["cpu"], "area"), "cpu_by_case": cpu_by(last["cpu"], "case"),
                        "cache": {**last["cache"], "hit_rate": hit_rate(last["cache"])}})
    print_table(["job", "rows", "serial s", f"-n {workers} s", "ratio", "same rows", "outcomes"], table)
    for entry in summary:
        _print_job(entry, timing)
    return summary, ok


def _print_job(entry: dict[str, Any], timing: set[str]) -> None:
    """The critical path of one job's parallel run, and its timing rows in both runs (what they measured)."""
    path = entry["critical_path"]
    longest = path["longest_other"]
    print(f"\n{entry['job']}: timing phase {path['timing_phase_s']:.1f} s (alone, serial); other cases "
          f"{path['other_case_s']:.1f} s of case time; longest other case "
          f"{longest['case'] if longest else '-'} {longest['duration_s'] if longest else 0:.1f} s")
    print_table(["case", "impl", "mode", "s", "timing"],
                [[c["case"], c["impl"], c["rank_mode"], c["duration_s"], "yes" if c["case"] in timing else ""]
                 for c in path["slowest"]])
    if entry["timing_rows"]:
        print()
        print_table(["run", "timing case", "impl", "outcome", "reason"],
                    [[t["run"], t["case"], t["impl"], t["outcome"], t["reason"]] for t in entry["timing_rows"]])


def main() -> None:
    parser = base_parser("suite_time", __doc__)
    parser.add_argument("--job", action="append", choices=sorted(JOBS), default=None,
                        help="main (reference) and/or all (--impl all); default: both")
    parser.add_argument("-n", dest="workers", default="2", help="workers of the parallel run (default: 2)")
    parser.add_argument("--rounds", type=int, default=1, help="serial/parallel pairs per job (default: 1)")
    parser.add_argument("-k", dest="keyword", default=None)
    parser.add_argument("--slowest", type=int, default=8)
    parser.add_argument("--parallel-first", action="store_true", help="start each job with the parallel run")
    parser.add_argument("--compare", type=Path, default=None,
                        help="an earlier report of this script: its CPU-seconds beside this run's (before/after)")
    args = parser.parse_args()
    earlier = {j["job"]: j for j in json.loads(args.compare.read_text())["jobs"]} if args.compare else {}
    if args.workers == "0":
        parser.error("-n 0: the parallel run needs at least one worker (or auto)")
    extra = ["-k", args.keyword] if args.keyword else []
    warn_without_bytecode_cache()
    runs = _measure(args.job or ["main", "all"], args.workers, args.rounds, extra, args.parallel_first)
    summary, ok = _report(runs, args.workers, args.slowest)
    for entry in summary:
        _print_cpu(entry, earlier.get(entry["job"]), args.slowest)
    write_json(args.json, {"workers": args.workers, "rounds": args.rounds, "jobs": summary,
                           "runs": {job: {mode: [{k: v for k, v in r.items() if k != "results"} for r in rs]
                                          for mode, rs in by_mode.items()} for job, by_mode in runs.items()}})
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
