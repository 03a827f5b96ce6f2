"""Per-case overhead of the harness vs PyTorch's multi-process test bases, side by side.

The same trivial case (one ``all_reduce`` of a one-element tensor) runs under:

- our process ranks (pool started once, then reused: the steady state of a suite);
- our thread ranks;
- PyTorch's ``MultiProcessTestCase`` (spawns and joins processes for every test);
- PyTorch's ``MultiProcContinuousTest`` (persistent workers per class), if present.

PyTorch's bases run as subprocesses (``run_tests``) with ``n`` generated
tests; the parent side records when the first test's ``setUp`` starts and when
the class is torn down, so the per-case figure excludes interpreter start and
imports (and, for ``MultiProcContinuousTest``, its one-off worker start, as
our figure excludes the pool start).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import harness
from bench._common import base_parser, print_table, save_plot, write_json


def trivial_case(ctx: harness.RankContext) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def ours(mode: str, world_size: int, cases: int) -> float:
    harness.run(trivial_case, world_size=world_size, mode=mode)  # start the pool / warm imports
    start = time.perf_counter()
    for _ in range(cases):
        harness.run(trivial_case, world_size=world_size, mode=mode)
    return (time.perf_counter() - start) / cases


_MPTC = """
import os, time, torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

STARTS = []

class Trivial(MultiProcessTestCase):
    @property
    def world_size(self):
        return {world_size}

    def setUp(self):
        STARTS.append(time.perf_counter())
        super().setUp()
        self._spawn_processes()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        with open(os.environ["BENCH_OUT"], "w") as f:
            f.write(repr((time.perf_counter() - STARTS[0]) / len(STARTS)))

    def _case(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()

{tests}

if __name__ == "__main__":
    run_tests()
"""

_CONTINUOUS = """
import os, time, torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

STARTS = []

class Trivial(MultiProcContinuousTest):
    world_size = {world_size}

    @classmethod
    def backend_str(cls):
        return "gloo"

    def setUp(self):
        STARTS.append(time.perf_counter())
        super().setUp()

    @classmethod
    def tearDownClass(cls):
        end = time.perf_counter()
        super().tearDownClass()
        with open(os.environ["BENCH_OUT"], "w") as f:
            f.write(repr((end - STARTS[0]) / len(STARTS)))

    def _case(self):
        t = torch.ones(1)
        dist.all_reduce(t)

{tests}

if __name__ == "__main__":
    run_tests()
"""


def torch_base(template: str, world_size: int, cases: int) -> float:
    """Per-case seconds of a PyTorch test base, measured inside its own process."""
    tests = "\n".join(f"    def test_{i}(self):\n        self._case()\n" for i in range(cases))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trivial_suite.py"
        out = Path(tmp) / "per_case.txt"
        path.write_text(textwrap.dedent(template.format(world_size=world_size, tests=tests)))
        env = {**os.environ, "BENCH_OUT": str(out)}
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp, env=env,
                              check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torch baseline failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return float(out.read_text())


def _has_continuous() -> bool:
    from torch.testing._internal import common_distributed

    return hasattr(common_distributed, "MultiProcContinuousTest")


def measure(world_sizes: list[int], cases: int, extra: int) -> list[dict[str, Any]]:
    rows = []
    for ws in world_sizes:
        row: dict[str, Any] = {"world_size": ws}
        row["ours_process_s"] = ours("process", ws, cases)
        row["ours_thread_s"] = ours("thread", ws, cases)
        row["multiprocess_testcase_s"] = torch_base(_MPTC, ws, extra)
        row["multiproc_continuous_s"] = torch_base(_CONTINUOUS, ws, cases) if _has_continuous() else None
        row["speedup_vs_multiprocess_testcase"] = row["multiprocess_testcase_s"] / row["ours_process_s"]
        rows.append(row)
    return rows


def main() -> None:
    parser = base_parser("harness_overhead", __doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", type=int, default=50, help="cases timed for our harness")
    parser.add_argument("--extra", type=int, default=4, help="tests timed for MultiProcessTestCase (slow)")
    args = parser.parse_args()
    try:
        rows = measure(args.world_sizes, args.cases, args.extra)
    finally:
        harness.shutdown_pools()

    def fmt(v: float | None) -> Any:
        return "n/a" if v is None else v

    print_table(
        ["ws", "ours process s/case", "ours thread s/case", "MultiProcessTestCase s/case",
         "MultiProcContinuousTest s/case", "speedup vs MPTC"],
        [[r["world_size"], r["ours_process_s"], r["ours_thread_s"], r["multiprocess_testcase_s"],
          fmt(r["multiproc_continuous_s"]), r["speedup_vs_multiprocess_testcase"]] for r in rows],
    )
    write_json(args.json, {"rows": rows, "cases": args.cases, "extra": args.extra})
    if args.plot:
        def draw(ax: Any) -> None:
            labels = ["ours process", "ours thread", "MultiProcessTestCase", "MultiProcContinuousTest"]
            keys = ["ours_process_s", "ours_thread_s", "multiprocess_testcase_s", "multiproc_continuous_s"]
            width = 0.8 / len(rows)
            for i, r in enumerate(rows):
                values = [r[k] or 0.0 for k in keys]
                ax.bar([x + i * width for x in range(len(keys))], values, width, label=f"ws {r['world_size']}")
            ax.set_xticks([x + width * (len(rows) - 1) / 2 for x in range(len(keys))], labels, rotation=15)
            ax.set_yscale("log")
            ax.set_ylabel("seconds per trivial case (log)")
            ax.set_title("Per-case overhead of multi-rank test harnesses")
            ax.legend()

        save_plot(args.plot, draw)


if __name__ == "__main__":
    main()
