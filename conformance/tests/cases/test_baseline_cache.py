"""Every kind of cached baseline the cases use equals a fresh computation of it, in both rank modes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from conformance.selftest.session import CASES_DIR

#: Rows that look up every kind of baseline the cases cache, each kind more than once (so some lookups hit).
SELECTION = ("(replicas_match_baseline and groups and 2x2) or "
             "(cpu_training_parity_vs_ddp and SGD and (FULL_SHARD or NO_SHARD)) or (parity_with_fsdp and SGD)")


def _kinds_in_cases() -> set[str]:
    texts = [path.read_text() for path in CASES_DIR.rglob("*.py")]
    return {kind for text in texts for kind in re.findall(r"\bcached\(\s*\"([a-z0-9-]+)\"", text)}


def test_cached_baselines_equal_fresh_ones(tmp_path: Path) -> None:
    """``FSDP_BASELINE_CACHE=verify``: each hit is recomputed and must equal the cached copy bit for bit
    ([Note: baseline cache] in ``fixtures/baselines.py``; its unit tests hold the negative control)."""
    log, report = tmp_path / "lookups", tmp_path / "r.json"
    env = {**os.environ, "FSDP_BASELINE_CACHE": "verify", "FSDP_BASELINE_CACHE_LOG": str(log)}
    proc = subprocess.run([sys.executable, "-m", "conformance", "run", "-n", "0", "--rank-mode", "both",
                           "-k", SELECTION, "--json", str(report)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(report.read_text())["rows"]
    assert len(rows) == 4 + 4 + 4 and {r["outcome"] for r in rows} == {"pass"}
    counts = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    kinds = _kinds_in_cases()
    assert kinds >= {"local-steps", "ddp-steps", "full-shard-losses"}, kinds
    unverified = sorted(kind for kind in kinds if not counts[(kind, "hit")])
    assert not unverified, f"kinds no row of the selection hit (add rows that do): {unverified}; {counts}"
