"""The conformance plugin and CLI end to end, in real pytest subprocesses."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

ADAPTERS = '''
from conformance.adapters.base import Capability
from conformance.adapters.reference import ReferenceAdapter

class Bare(ReferenceAdapter):
    """The reference declaring nothing but thread ranks."""
    name = "bare"
    capabilities = frozenset({Capability.THREAD_RANKS})

class ProcessOnly(ReferenceAdapter):
    """The reference declaring no capability at all, not even thread ranks."""
    name = "process-only"
    capabilities = frozenset()
'''

CASES = '''
import pytest, torch, torch.distributed as dist
from conformance.adapters.base import Capability
from conformance.case import case

@case("demo/passes", world_size=2)
def test_passes(ctx, impl):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0

@case("demo/fails", world_size=2, modes=("thread",))
def test_fails(ctx, impl):
    assert ctx.rank == 0, "rank 1 sees a different world"

@case("demo/needs_capability", world_size=2, modes=("process",),
      requires=[Capability.EXEC_ORDER_VALIDATION])
def test_needs_capability(ctx, impl):
    pass

@case("demo/needs_gpus", world_size=2, accelerators=2)
def test_needs_gpus(ctx, impl):
    raise AssertionError("must never run without GPUs")
'''


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(demo_adapters=ADAPTERS, test_demo=CASES)
    adapters = "bare=demo_adapters:Bare,process-only=demo_adapters:ProcessOnly,broken=no_such_module:Nope"
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", adapters)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    return pytester


def test_outcomes_matrix_and_reports(suite: pytest.Pytester) -> None:
    out = suite.path / "r.json"
    md = suite.path / "r.md"
    result = suite.runpytest_subprocess(
        "--fsdp-impl", "reference", "--fsdp-impl", "bare", "--fsdp-impl", "process-only", "--conformance-progress",
        "--conformance-json", str(out), "--conformance-markdown", str(md), "-p", "no:cacheprovider",
    )
    assert result.ret == 1
    rows = {(r["case"], r["impl"], r["rank_mode"]): r for r in json.loads(out.read_text())}
    assert rows[("demo/passes", "reference", "process")]["outcome"] == "pass"
    failed = rows[("demo/fails", "bare", "thread")]
    assert failed["outcome"] == "FAIL"
    assert "rank 1 raised AssertionError: rank 1 sees a different world" in failed["reason"]
    na = rows[("demo/needs_capability", "bare", "process")]
    assert na["outcome"] == "n/a" and na["reason"] == "bare lacks capability exec_order_validation"
    assert rows[("demo/needs_capability", "reference", "process")]["outcome"] == "pass"
    assert rows[("demo/passes", "process-only", "process")]["outcome"] == "pass"
    no_threads = rows[("demo/passes", "process-only", "thread")]
    assert no_threads["outcome"] == "n/a" and no_threads["reason"] == "process-only lacks capability thread_ranks"
    gpu = rows[("demo/needs_gpus", "reference", "thread")]
    assert gpu["outcome"] == "skip" and gpu["reason"] == "needs 2 accelerators, found 0"
    assert all(set(r) == {"case", "impl", "rank_mode", "world_size", "outcome", "reason", "duration_s", "metrics"}
               for r in rows.values())
    result.stdout.fnmatch_lines(["*conformance matrix*", "case * reference/process*", "conformance: *FAIL*"])
    assert "| `demo/needs_capability` |" in md.read_text()


def test_unloadable_adapter_is_an_error_row_not_a_crash(suite: pytest.Pytester) -> None:
    out = suite.path / "r.json"
    result = suite.runpytest_subprocess("--fsdp-impl", "broken", "-k", "passes", "--conformance-json", str(out))
    rows = json.loads(out.read_text())
    assert {r["outcome"] for r in rows} == {"error"}
    assert "adapter 'broken' failed to load: ModuleNotFoundError" in rows[0]["reason"]
    assert result.ret == 1


def test_unknown_implementation_is_a_usage_error(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("--fsdp-impl", "nope")
    result.stderr.fnmatch_lines(["*--fsdp-impl: unknown implementation(s)*nope*registered: *reference*"])
    assert result.ret == 4


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conformance", *args], capture_output=True, text=True, check=False)


def test_cli_list_impls_and_empty_selection() -> None:
    listed = _cli("list", "-k", "exec_order")
    assert listed.returncode == 0
    assert re.search(r"^exec_order/invalid_later_iter_order\[FULL_SHARD-3\] +cpu, ws 2; modes process/thread$",
                     listed.stdout, re.M), listed.stdout
    assert listed.stdout.splitlines()[-1] == "8 cases"
    impls = _cli("impls")
    assert "reference      ok" in impls.stdout and "torch-fsdp2    ok" in impls.stdout
    empty = _cli("run", "-k", "no_case_has_this_name")
    assert empty.returncode == 5 and "no case matched the selection" in empty.stderr
    unknown = _cli("run", "--impl", "nope")
    assert unknown.returncode == 2 and "unknown implementation 'nope'" in unknown.stderr
