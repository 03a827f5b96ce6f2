"""Run what an :class:`Expect` names against patched adapters, and report the rows that did not FAIL.

The public way to prove that cases can fail, for this suite's mutants and for
out-of-tree tools mutating their own implementation::

    from conformance.selftest import Expect, Patch, PatchedAdapter, uncaught
    from my_fsdp.conformance_adapter import MyAdapter

    class NeverReshards(PatchedAdapter, MyAdapter):
        name = "my-fsdp-never-reshards"
        breaks = "resharding after forward"
        expect = Expect("reshard", "thread", ("hybrid_shard/basic_setup",))
        patches = (Patch.instead("my_fsdp.unit:reshard", lambda *a, **k: None),)

    problems = uncaught({"my-fsdp-never-reshards": "my_tests.mutants:NeverReshards"}, report="r.json")
    assert not problems, problems

One pytest session runs every given adapter's rows (each selected by its own
``Expect.keyword``, one ``--fsdp-impl`` per adapter); the rows come back
through the JSON report and are checked against each ``Expect.must_fail``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conformance.contract.registry import ENV_VAR
from conformance.contract.rows import row_matches
from conformance.selftest.declare import Expect

__all__ = ["CASES_DIR", "problems_of", "run_session", "uncaught"]

#: The suite's case files: the default for :func:`uncaught`.
CASES_DIR = Path(__file__).resolve().parents[1] / "cases"
#: The suite's pytest plugins ([Note: opt-in plugins]; ``conformance.runner.PYTEST_PLUGIN``, which this
#: package may not import).
PYTEST_PLUGIN = "conformance.pytest_plugin"


def _expect_of(spec: str) -> Expect:
    """The ``expect`` of the class ``module:Class`` names."""
    module_name, _, cls_name = spec.partition(":")
    expect = getattr(getattr(importlib.import_module(module_name), cls_name), "expect", None)
    if not isinstance(expect, Expect):
        raise TypeError(f"{spec} declares no `expect = Expect(...)`")
    return expect


def run_session(adapters: Mapping[str, str], expects: Mapping[str, Expect], *, report: str | os.PathLike[str],
                files: Sequence[str] = (), options: Sequence[str] = (), timeout_s: float = 900) -> list[dict[str, Any]]:
    """The rows of one pytest session running each adapter's ``expects[name].keyword`` rows.

    ``adapters``: name -> ``module:Class`` (registered through ``FSDP_CONFORMANCE_ADAPTERS``);
    every expectation must share one rank mode. ``options``: more pytest arguments, after the
    session's own (a later ``-k`` or ``--fsdp-rank-mode`` wins). RuntimeError with pytest's output
    when no report was written (a collection error, say).
    """
    modes = {e.rank_mode for e in expects.values()}
    if len(modes) != 1:
        raise ValueError(f"one session runs one rank mode; the expectations ask for {sorted(modes)}")
    keyword = " or ".join(f"({name} and ({expects[name].keyword}))" for name in adapters)
    args = [arg for name in adapters for arg in ("--fsdp-impl", name)]
    args += ["--fsdp-rank-mode", modes.pop(), "-k", keyword, *options]
    path = Path(report)
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *(files or [str(CASES_DIR)]), "-q", "-p", "no:cacheprovider",
           "-p", PYTEST_PLUGIN, *args,
           "--conformance-json", str(path)]
    registered = ",".join(f"{name}={spec}" for name, spec in adapters.items())
    env = {**os.environ, ENV_VAR: ",".join(filter(None, (os.environ.get(ENV_VAR), registered)))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    if not path.exists():
        raise RuntimeError(f"no report from {' '.join(cmd)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    loaded = json.loads(path.read_text())
    return list(loaded["rows"] if isinstance(loaded, dict) else loaded)


def problems_of(name: str, expect: Expect, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """What is wrong with ``name``'s rows: a ``must_fail`` pattern matching none, or a selected row not FAILing."""
    mine = [r for r in rows if r["impl"] == name]
    unmatched = [p for p in expect.must_fail if not any(row_matches(r["case"], p) for r in mine)]
    if unmatched:
        return [f"{name}: no row matched {unmatched}; the expectation is stale"]
    selected = [r for r in mine if any(row_matches(r["case"], p) for p in expect.must_fail)]
    return [f"{name} was not caught by {r['case']} ({r['rank_mode']}): {r['outcome']}"
            for r in selected if r["outcome"] != "FAIL"]


def uncaught(adapters: Mapping[str, str], *, report: str | os.PathLike[str], files: Sequence[str] = (),
             options: Sequence[str] = (), timeout_s: float = 900) -> list[str]:
    """Run every adapter's ``expect`` (its class attribute) in one session; the problems, empty when all FAIL."""
    expects = {name: _expect_of(spec) for name, spec in adapters.items()}
    rows = run_session(adapters, expects, report=report, files=files, options=options, timeout_s=timeout_s)
    return [p for name, expect in expects.items() for p in problems_of(name, expect, rows)]
