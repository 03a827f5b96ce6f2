"""The walk from ``--fsdp-impl`` to a row's ranks decides each thing once, counted.

* The adapters are loaded once per session process: a serial run loads each
  once; under ``-n 2`` each worker process loads each once (it collects the
  rows itself), and the controller, which collects nothing, loads none.
* The rank-mode selection is resolved once per session process; a row's rank
  mode is its ``rank_mode`` parameter.
* A row's placement is decided once (:func:`harness.ranks.devices.decide`, in the
  conformance plugin's setup) and the harness runs the row's ranks once, under
  that placement and the row's rank mode, as its report records them.

A counting plugin (:data:`COUNTING`) wraps the functions that load, resolve,
decide and run, writes one line per call, and puts them back when its session
ends.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import harness
from conformance.contract import registry
from harness.ranks import devices
from harness.tests.inprocess import pytester_run

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester", "harness.tests.inprocess"]

CASES = '''
import pytest, torch, torch.distributed as dist
from conformance.contract.case import case

@case("demo/sums", world_size=2)
@pytest.mark.parametrize("n", [1, 2])
def test_sums(ctx, impl, n):
    t = torch.ones(1) * n
    dist.all_reduce(t)
    assert t.item() == 2.0 * n

@case("demo/threads_only", world_size=2, modes=("thread",))
def test_threads_only(ctx, impl):
    pass
'''

#: Loaded with ``-p counting``, before any session hook: each call it wraps appends a JSON line to $COUNTS.
COUNTING = '''
import json, os
import pytest
import harness
import harness.plugin.pytest_plugin
from conformance.contract import registry
from harness.ranks import devices

_row = {"nodeid": None, "impl": None}

def _log(kind, **fields):
    with open(os.environ["COUNTS"], "a") as f:
        f.write(json.dumps({"kind": kind, "pid": os.getpid(), "row": _row["nodeid"], "impl": _row["impl"],
                            **fields}) + "\\n")

def _counted(kind, fn, describe):
    def wrapper(*args, **kwargs):
        _log(kind, **describe(*args, **kwargs))
        return fn(*args, **kwargs)
    return wrapper

_PATCHED = [
    (registry, "load", lambda name: {"name": name}),
    (harness.plugin.pytest_plugin, "resolve_selection", lambda **kw: {}),
    (devices, "decide", lambda **kw: {}),
    (harness, "run", lambda fn, **kw: {"mode": str(kw["mode"].value), "placement": kw["placement"]}),
]
_ORIGINALS = [(owner, name, getattr(owner, name)) for owner, name, _ in _PATCHED]
_KINDS = {"load": "load", "resolve_selection": "resolve_rank_mode", "decide": "decide_placement", "run": "run"}
for owner, name, describe in _PATCHED:
    setattr(owner, name, _counted(_KINDS[name], getattr(owner, name), describe))

def pytest_unconfigure(config):
    """Put the originals back: an in-process session shares these modules with the test that ran it."""
    for owner, name, original in _ORIGINALS:
        setattr(owner, name, original)

@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _row.update(nodeid=item.nodeid, impl=getattr(item.callspec.params.get("impl"), "name", None))
    try:
        return (yield)
    finally:
        _row.update(nodeid=None, impl=None)
'''

IMPLS = ("--fsdp-impl", "reference", "--fsdp-impl", "bare")


@pytest.fixture
def suite(preloaded: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_demo=CASES, counting=COUNTING,
                        demo_adapters="from conformance.adapters.reference import ReferenceAdapter\n"
                                      "class Bare(ReferenceAdapter):\n    name = 'bare'\n")
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", "bare=demo_adapters:Bare")
    monkeypatch.setenv("COUNTS", str(pytester.path / "counts.jsonl"))
    return pytester


def _counts(suite: pytest.Pytester) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (suite.path / "counts.jsonl").read_text().splitlines()]


def _rows(report: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(case, impl, rank mode) -> the report's row."""
    return {(r["case"], r["impl"], r["rank_mode"]): r for r in json.loads(report.read_text())["rows"]}


def _check_rows(calls: list[dict[str, Any]], report: Path) -> None:
    """One placement decision and one harness run per row that ran, under the mode and placement reported."""
    rows = _rows(report)
    ran = {key: row for key, row in rows.items() if row["outcome"] == "pass"}
    assert len(ran) == 2 * (2 * 2 + 1), rows  # 2 impls x (demo/sums: 2 params x 2 modes + threads_only: 1)
    decided = Counter(c["row"] for c in calls if c["kind"] == "decide_placement")
    runs = [c for c in calls if c["kind"] == "run"]
    assert len(decided) == len(ran) and set(decided.values()) == {1}, decided
    assert len(runs) == len(ran) and len({c["row"] for c in runs}) == len(ran), runs
    assert set(decided) == {c["row"] for c in runs}
    assert sorted((c["impl"], c["mode"], c["placement"]) for c in runs) == \
        sorted((row["impl"], row["rank_mode"], row["placement"]) for row in ran.values())
    assert {c["placement"] for c in runs} == {"cpu"}

def test_a_serial_run_loads_resolves_and_decides_once(suite: pytest.Pytester) -> None:
    out = suite.path / "r.json"
    before = (registry.load, devices.decide, harness.run)
    result = pytester_run(suite, "-p", "counting", *IMPLS, "--fsdp-rank-mode", "both",
                          "--conformance-json", str(out))
    assert result.ret == 0, result.stdout.str()[-3000:]
    calls = _counts(suite)
    assert (registry.load, devices.decide, harness.run) == before, "the counting plugin must put the originals back"
    assert {c["pid"] for c in calls} == {os.getpid()}
    assert Counter(c["name"] for c in calls if c["kind"] == "load") == {"reference": 1, "bare": 1}
    assert sum(c["kind"] == "resolve_rank_mode" for c in calls) == 1
    _check_rows(calls, out)


def test_each_worker_loads_the_adapters_once(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``-n 2`` the statement is per process: every worker loads each adapter once."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(suite.path), os.environ.get("PYTHONPATH", "")]))
    out = suite.path / "r.json"
    result = suite.runpytest_subprocess("-n", "2", "-p", "conformance.pytest_plugin", "-p", "counting", *IMPLS,
                                        "--fsdp-rank-mode", "both", "-p", "no:cacheprovider",
                                        "--conformance-json", str(out))
    assert result.ret == 0, result.stdout.str()[-3000:]
    calls = _counts(suite)
    loads = [c for c in calls if c["kind"] == "load"]
    workers = {c["pid"] for c in loads}
    assert len(workers) == 2, loads
    for pid in workers:
        assert Counter(c["name"] for c in loads if c["pid"] == pid) == {"reference": 1, "bare": 1}, loads
    resolved = Counter(c["pid"] for c in calls if c["kind"] == "resolve_rank_mode")
    assert set(resolved.values()) == {1} and workers < set(resolved), resolved  # the controller resolves too
    _check_rows(calls, out)
