"""The conformance plugin and CLI end to end, in nested in-process sessions ([Note: in-process sessions])."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conformance.runner import cli
from harness.tests.inprocess import MainResult, pytester_run, run_main

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester", "harness.tests.inprocess"]

ADAPTERS = '''
from conformance.contract.adapter import Capability
from conformance.adapters.reference import ReferenceAdapter

class Bare(ReferenceAdapter):
    """The reference declaring nothing but thread ranks."""
    name = "bare"
    capabilities = frozenset({Capability.THREAD_RANKS})

class NoNoShard(ReferenceAdapter):
    """The reference refusing NO_SHARD and the hybrid strategies."""
    name = "no-no-shard"
    def supports_strategy(self, strategy):
        return strategy not in ("NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")

class ProcessOnly(ReferenceAdapter):
    """The reference declaring no capability at all, not even thread ranks."""
    name = "process-only"
    capabilities = frozenset()
'''

CASES = '''
import pytest, torch, torch.distributed as dist
from conformance.contract.adapter import Capability
from conformance.contract.case import case, distinct_gpus

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

@case("demo/needs_gpus", world_size=2, gpus=distinct_gpus(2))
def test_needs_gpus(ctx, impl):
    raise AssertionError("must never run without GPUs")
'''

REPORTING = '''
import pytest
from conformance.contract.case import case
from conformance.contract.results import CaseReport

@case("demo/reports", world_size=2, modes=("thread",))
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("variant", ["A", None])
def test_reports(ctx, impl, variant, n, case_settings):
    return CaseReport(reason=f"rank {ctx.rank} says hi", metrics={"repeats": case_settings.timing_repeats, "n": n})

@case("demo/returns_dict", world_size=2, modes=("thread",))
def test_returns_dict(ctx, impl):
    return {"reason": "old style"}
'''

DECISIONS = '''
import pytest
from conformance.contract.case import case

@case("demo/strategies", world_size=2, modes=("thread",))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_strategies(ctx, impl, strategy):
    pass

@case("demo/hybrid_inside", world_size=2, modes=("thread",), strategies=["HYBRID_SHARD"])
def test_hybrid_inside(ctx, impl):
    pass

@case("demo/process_only", world_size=2, modes=("process",))
def test_process_only(ctx, impl):
    raise AssertionError("never runs on thread ranks")

@case("demo/skips_in_body", world_size=2, modes=("thread",))
def test_skips_in_body(ctx, impl):
    pytest.skip("feeling lazy")
'''

RESULT_LISTENER = '''
def pytest_conformance_result(config, result):
    with open(config.rootpath / "listened.txt", "a") as f:
        f.write(f"{result.case} {result.outcome}\\n")
'''


@pytest.fixture
def suite(preloaded: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(demo_adapters=ADAPTERS, test_demo=CASES)
    adapters = ("bare=demo_adapters:Bare,process-only=demo_adapters:ProcessOnly,broken=no_such_module:Nope,"
                "no-no-shard=demo_adapters:NoNoShard")
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", adapters)
    monkeypatch.setenv("COLUMNS", "400")  # the wide matrix these tests read, whatever pytest's environment
    return pytester


def test_outcomes_matrix_and_reports(suite: pytest.Pytester) -> None:
    out = suite.path / "r.json"
    md = suite.path / "r.md"
    result = pytester_run(
        suite, "--fsdp-impl", "reference", "--fsdp-impl", "bare", "--fsdp-impl", "process-only",
        "--conformance-progress",
        "--conformance-json", str(out), "--conformance-markdown", str(md), "-p", "no:cacheprovider",
        "--fsdp-device", "cpu",  # the same rows on every machine
    )
    assert result.ret == 1
    rows = {(r["case"], r["impl"], r["rank_mode"]): r for r in json.loads(out.read_text())["rows"]}
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
    assert gpu["outcome"] == "skip" and gpu["reason"] == "needs 2 distinct GPUs; the device setting is cpu"
    assert gpu["placement"] == "" and rows[("demo/passes", "reference", "process")]["placement"] == "cpu"
    assert all(set(r) == {"case", "impl", "rank_mode", "world_size", "outcome", "reason", "duration_s", "metrics",
                          "placement", "finding"} for r in rows.values())
    result.stdout.fnmatch_lines(["*conformance matrix*", "case * reference/process*", "conformance: *FAIL*"])
    assert "| `demo/needs_capability` |" in md.read_text()


def test_unloadable_adapter_is_an_error_row_not_a_crash(suite: pytest.Pytester) -> None:
    out = suite.path / "r.json"
    result = pytester_run(suite, "--fsdp-impl", "broken", "-k", "passes", "--conformance-json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {r["outcome"] for r in rows} == {"error"}
    assert "adapter 'broken' failed to load: ModuleNotFoundError" in rows[0]["reason"]
    assert result.ret == 1


def test_unknown_implementation_is_a_usage_error(suite: pytest.Pytester) -> None:
    result = pytester_run(suite, "--fsdp-impl", "nope")
    result.stderr.fnmatch_lines(["*--fsdp-impl=?'nope'?: unknown implementation(s) ?'nope'?; registered: *reference*"])
    assert result.ret == 4


def _cli(*args: str) -> MainResult:
    return run_main(cli.main, *args)


def test_cli_list_impls_and_empty_selection() -> None:
    listed = _cli("list", "-k", "exec_order")
    assert listed.returncode == 0
    assert re.search(r"^exec_order/invalid_later_iter_order\[strategy=FULL_SHARD,iters_before_path_change=3\] +cpu, "
                     r"ws >=2; modes process/thread; timeout 120 s; requires exec_order_validation, thread_ranks$",
                     listed.stdout, re.M), listed.stdout
    assert listed.stdout.splitlines()[-1] == "8 cases"
    impls = _cli("impls")
    assert "reference      ok" in impls.stdout and "torch-fsdp2    ok" in impls.stdout
    empty = _cli("run", "-k", "no_case_has_this_name")
    assert empty.returncode == 5 and "no case matched the selection" in empty.stderr
    unknown = _cli("run", "--impl", "nope")
    assert unknown.returncode == 2 and "--fsdp-impl=['nope']: unknown implementation(s) ['nope']" in unknown.stderr


def test_case_reports_row_ids_and_the_result_hook(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_reporting=REPORTING)
    suite.makeconftest(RESULT_LISTENER)
    monkeypatch.setenv("FSDP_CONFORMANCE_TIMING_REPEATS", "7")
    out = suite.path / "r.json"
    result = pytester_run(suite, "test_reporting.py", "--conformance-json", str(out), "-p", "no:cacheprovider")
    assert result.ret == 1
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["demo/reports[variant=A,n=1]", "demo/reports[variant=A,n=2]",
                            "demo/reports[variant=None,n=1]", "demo/reports[variant=None,n=2]",
                            "demo/returns_dict"]
    reported = rows["demo/reports[variant=None,n=2]"]
    assert reported["outcome"] == "pass" and reported["reason"] == "rank 0 says hi"
    assert reported["metrics"] == {"repeats": 7, "n": 2}
    bad = rows["demo/returns_dict"]
    assert bad["outcome"] == "FAIL"
    assert ("demo/returns_dict returned dict; a case returns None or "
            "conformance.contract.results.CaseReport") in bad["reason"]
    listened = (suite.path / "listened.txt").read_text().splitlines()
    assert sorted(listened) == sorted(f"{case} {row['outcome']}" for case, row in rows.items())
    result.stdout.fnmatch_lines(["fsdp-conformance: impls: ('reference',) (from default); rank mode: both *"
                                 "timing repeats: 7 (from FSDP_CONFORMANCE_TIMING_REPEATS); workers: 0 (from default); "
                                 "device: auto (from default); fuzz examples: None (from default)*"])


def test_timing_repeats_option_wins_over_the_environment(suite: pytest.Pytester,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_reporting=REPORTING)
    monkeypatch.setenv("FSDP_CONFORMANCE_TIMING_REPEATS", "7")
    out = suite.path / "r.json"
    pytester_run(suite, "test_reporting.py", "-k", "reports and A-1", "--fsdp-timing-repeats", "2",
                 "--conformance-json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["metrics"]["repeats"] == 2


def test_cli_run_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_RANK_MODE", "thread")
    out = tmp_path / "r.json"
    run = _cli("run", "-k", "exec_order and train_eval", "--json", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "rank mode: thread (from FSDP_RANK_MODE)" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows and {r["rank_mode"] for r in rows} == {"thread"}
    monkeypatch.setenv("FSDP_CONFORMANCE_IMPL", "nope")
    bad = _cli("run", "-k", "train_eval")
    assert bad.returncode == 2 and "FSDP_CONFORMANCE_IMPL='nope': unknown implementation(s)" in bad.stderr


def _rows_without_times(path: Path) -> list[tuple]:
    return sorted((r["case"], r["impl"], r["rank_mode"], r["outcome"], r["reason"], r["placement"])
                  for r in json.loads(path.read_text())["rows"])


def test_device_env_and_option_give_the_same_rows(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    by_option, by_env = suite.path / "option.json", suite.path / "env.json"
    common = ("-k", "passes or needs_gpus", "-p", "no:cacheprovider")
    pytester_run(suite, "--fsdp-device", "cpu", "--conformance-json", str(by_option), *common)
    monkeypatch.setenv("FSDP_DEVICE", "cpu")
    pytester_run(suite, "--conformance-json", str(by_env), *common)
    assert _rows_without_times(by_option) == _rows_without_times(by_env)
    assert {r[5] for r in _rows_without_times(by_env)} == {"cpu", ""}


def test_bad_device_names_its_source(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_DEVICE", "gpu")
    result = pytester_run(suite, "-k", "passes")
    result.stderr.fnmatch_lines(["*FSDP_DEVICE='gpu': expected one of auto, cpu, cuda*"])
    assert result.ret == 4


def test_rows_decided_before_ranks_start(suite: pytest.Pytester) -> None:
    """Refused strategies and excluded rank modes are n/a with reasons; a body's skip is not a hardware skip."""
    suite.makepyfile(test_decisions=DECISIONS)
    out, md = suite.path / "r.json", suite.path / "r.md"
    result = pytester_run(suite, "test_decisions.py", "--fsdp-impl", "no-no-shard", "--fsdp-rank-mode", "thread",
                          "--conformance-json", str(out), "--conformance-markdown", str(md))
    assert result.ret == 1
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["demo/strategies[strategy=FULL_SHARD]"]["outcome"] == "pass"
    refused = rows["demo/strategies[strategy=NO_SHARD]"]
    assert (refused["outcome"], refused["reason"]) == ("n/a", "no-no-shard does not support strategy NO_SHARD")
    declared = rows["demo/hybrid_inside"]
    assert (declared["outcome"], declared["reason"]) == ("n/a", "no-no-shard does not support strategy HYBRID_SHARD")
    excluded = rows["demo/process_only"]
    assert (excluded["outcome"], excluded["rank_mode"]) == ("n/a", "thread")
    assert excluded["reason"] == "demo/process_only is declared for process ranks only, which excludes thread ranks"
    lazy = rows["demo/skips_in_body"]
    assert lazy["outcome"] == "error" and "skip means missing hardware" in lazy["reason"]
    assert "feeling lazy" in lazy["reason"]
    markdown = md.read_text()
    assert "NotSetType" not in markdown
    assert re.search(r"^\| `demo/process_only` \|.*\| n/a \|$", markdown, re.M), markdown


def test_cli_forwards_the_rank_mode_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank mode is resolved once, by the harness's plugin in the session: the CLI only forwards it."""
    from harness.ranks import rank_mode

    def must_not_resolve(**_: object) -> None:
        raise AssertionError("the CLI resolved the rank mode itself")

    monkeypatch.setattr(rank_mode, "resolve_selection", must_not_resolve)
    monkeypatch.setenv("FSDP_RANK_MODE", "thread")
    args = cli._run_args(cli._parser().parse_args(["run"]))
    assert "--fsdp-rank-mode" not in args  # the environment is the session's to read
    args = cli._run_args(cli._parser().parse_args(["run", "--rank-mode", "bogus", "--launcher", "torchrun"]))
    assert args[args.index("--fsdp-rank-mode") + 1] == "bogus"
    assert args[args.index("--fsdp-launcher") + 1] == "torchrun"
