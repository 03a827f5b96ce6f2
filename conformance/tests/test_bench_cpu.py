"""The CPU figures bench.suite_time reports: a row's process tree, summed per area and per case."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.cpu_probe import tree_cpu_s
from bench.suite_time import cpu_by, hit_rate

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

BURN = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"


def test_the_tree_counts_a_descendant_that_has_exited() -> None:
    """A rank process's time moves into its parent's account when it is reaped: still counted."""
    before = tree_cpu_s(os.getpid())
    # A grandchild: the child starts it, waits for it, and exits; this process reaps the child.
    subprocess.run([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN!r}])"],
                   check=True)
    assert tree_cpu_s(os.getpid()) - before >= 0.35


def test_rows_sum_per_area_and_per_case() -> None:
    rows = [{"case": "a/x[p=1]", "cpu_s": 1.0}, {"case": "a/x[p=2]", "cpu_s": 2.0},
            {"case": "a/y", "cpu_s": 0.5}, {"case": "b/z[q=0]", "cpu_s": 4.0}]
    assert cpu_by(rows, "area") == {"b": 4.0, "a": 3.5}
    assert cpu_by(rows, "case") == {"b/z": 4.0, "a/x": 3.0, "a/y": 0.5}
    assert hit_rate({"hits": 3, "misses": 1}) == 0.75 and hit_rate({"hits": 0, "misses": 0}) is None
