"""World size as a property of the run: exact and scalable declarations, ``--world-size``, launched jobs
([Note: world sizes] in :mod:`conformance.contract.world_size`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.contract.case import CaseSpec, Exact, Scalable
from conformance.contract.world_size import SizeDecision, decide_world_size
from harness.tests.inprocess import pytester_run

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

pytest_plugins = ["pytester", "harness.tests.inprocess"]

CASES = '''
from conformance.contract.case import Exact, Scalable, case

@case("demo/scales", world_size=Scalable(default=2, minimum=2), modes=("thread",))
def test_scales(ctx, impl):
    assert ctx.world_size == SIZE, (ctx.world_size, SIZE)

@case("demo/pair", world_size=Exact(2, reason="a pair of ranks by design"), modes=("thread",))
def test_pair(ctx, impl):
    assert ctx.world_size == 2
'''


@pytest.mark.parametrize(
    ("declared", "pattern"),
    [
        (lambda: Scalable(default=2, minimum=3), r"minimum\(3\) > default\(2\)"),
        (lambda: Scalable(default=3, minimum=2, multiple_of=2), r"default\(3\) is not a multiple of multiple_of\(2\)"),
        (lambda: Scalable(default=0), r"default must be an int >= 1, got default=0"),
        (lambda: Scalable(default=2, multiple_of=0), r"multiple_of must be an int >= 1, got multiple_of=0"),
        (lambda: Exact(0), r"Exact world size must be an int >= 1, got size=0"),
        (lambda: CaseSpec(id="a/b", world_size=0), r"case a/b: world_size must be >= 1, got 0"),
        (lambda: CaseSpec(id="a/b", world_size="4"), r"case a/b: world_size must be an int, Exact\(...\) or "
                                                     r"Scalable\(...\), got '4'"),
    ],
)
def test_bad_world_size_declarations_name_the_values(declared: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        declared()  # type: ignore[operator]


def test_requirements_as_list_shows_them() -> None:
    assert CaseSpec(id="a/b", world_size=2).needs_text({}) == "cpu, ws 2"
    assert CaseSpec(id="a/b", world_size=Scalable(default=2, minimum=2)).needs_text({}) == "cpu, ws >=2"
    assert Scalable(default=2, minimum=1).describe() == "ws >=1 (default 2)"
    assert Scalable(default=4, minimum=2, multiple_of=2).describe() == "ws >=2, multiple of 2 (default 4)"


@pytest.mark.parametrize(
    ("need", "requested", "expected"),
    [
        (Scalable(default=2, minimum=2), None, SizeDecision(2)),
        (Scalable(default=2, minimum=2), 5, SizeDecision(5)),
        (Scalable(default=2, minimum=2), 1, SizeDecision(None, "needs a world size >= 2, the run asks for 1 "
                                                               "(--world-size)")),
        (Exact(1), None, SizeDecision(1)),
        (Exact(4, reason="two nodes of two"), 3, SizeDecision(None, "needs world size 4 (two nodes of two), the "
                                                                    "run asks for 3 (--world-size)")),
    ],
)
def test_process_and_thread_rows_run_at_the_default_or_the_size_asked_for(
        need: Exact | Scalable, requested: int | None, expected: SizeDecision) -> None:
    assert decide_world_size(need, requested=requested) == expected


@pytest.mark.parametrize(
    ("need", "job", "expected"),
    [
        (Scalable(default=2, minimum=2, multiple_of=2), 4, SizeDecision(4)),
        (Scalable(default=2, minimum=2, multiple_of=2), 16, SizeDecision(16)),
        (Scalable(default=2, minimum=2), 1, SizeDecision(None, "needs a world size >= 2, the launched job has 1")),
        (Exact(4, reason="two nodes of two"), 2,
         SizeDecision(None, "needs world size 4 (two nodes of two), the launched job has 2")),
        (Exact(2), 2, SizeDecision(2)),
    ],
)
def test_a_launched_job_runs_a_row_at_its_own_size_when_the_case_accepts_it(
        need: Exact | Scalable, job: int, expected: SizeDecision) -> None:
    # the job's size decides, whatever the default: a row never runs at a size its case does not accept
    assert decide_world_size(need, requested=None, launched_job=job) == expected


@pytest.mark.parametrize(
    ("need", "job", "node_ranks", "size"),
    [
        (Exact(1), 4, 2, 1),
        (Exact(2), 4, 2, 2),
        (Exact(4), 8, 4, 4),
        (Scalable(default=2, minimum=2, multiple_of=2), 3, 3, 2),
        (Scalable(default=4, minimum=2, multiple_of=2), 7, 7, 6),
    ],
)
def test_a_launched_job_runs_a_smaller_row_on_one_node_at_the_largest_size_that_fits(
        need: Exact | Scalable, job: int, node_ranks: int, size: int) -> None:
    decision = decide_world_size(need, launched_job=job, node_ranks=node_ranks)
    assert decision.size == size and not decision.reason, decision
    assert decision.note == (f"ran on {size} process rank{'s' * (size > 1)} spawned on node 0 (it needs "
                             f"{need.requirement()}; the launched job has {job}, its other ranks waited)")


def test_a_smaller_row_that_fits_on_no_node_is_skipped_naming_the_layout() -> None:
    decision = decide_world_size(Exact(2), launched_job=4, node_ranks=1)
    assert decision == SizeDecision(None, "needs world size 2, the launched job has 4 (4 node(s) of 1 rank(s): a "
                                          "smaller row runs within one node)")
    # no node given: the job is one node
    assert decide_world_size(Exact(2), launched_job=4).size == 2


@pytest.fixture
def suite(preloaded: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("FSDP_RANK_MODE", raising=False)
    monkeypatch.delenv("FSDP_WORLD_SIZE", raising=False)
    return pytester


def _rows(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    return {r["case"]: r for r in data["rows"]}


@pytest.mark.parametrize("size", [None, 3])
def test_world_size_setting_runs_scalable_rows_at_it_and_skips_exact_ones(suite: pytest.Pytester,
                                                                          size: int | None) -> None:
    suite.makepyfile(test_demo=CASES.replace("SIZE", str(size or 2)))
    out = suite.path / "r.json"
    given = ["--fsdp-world-size", str(size)] if size else []
    result = pytester_run(suite, "--fsdp-rank-mode", "thread", *given, "--conformance-json", str(out))
    rows = _rows(out)
    assert rows["demo/scales"]["outcome"] == "pass", rows["demo/scales"]
    assert rows["demo/scales"]["world_size"] == (size or 2)
    if size is None:
        assert result.ret == 0 and rows["demo/pair"]["outcome"] == "pass" and rows["demo/pair"]["world_size"] == 2
    else:
        assert rows["demo/pair"]["outcome"] == "skip"
        assert rows["demo/pair"]["reason"] == ("needs world size 2 (a pair of ranks by design), the run asks for 3 "
                                               "(--world-size)")


def test_world_size_setting_is_checked(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_demo=CASES.replace("SIZE", "2"))
    result = pytester_run(suite, "--fsdp-world-size", "0")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--fsdp-world-size='0': expected a whole number >= 1*"])


def test_a_launched_job_takes_no_other_world_size() -> None:
    from conformance.runner.settings import resolve_settings
    from conformance.runner.world_sizes import check_launched_size
    from harness.setting_sources import Resolved

    launched = Resolved("rank mode", "launched", "--fsdp-rank-mode")
    asked = resolve_settings({"world_size": ("--fsdp-world-size", "2")}, rank_mode=launched, env={})
    check_launched_size(asked, "2")  # repeating the job's size is fine
    with pytest.raises(ValueError, match=r"--fsdp-world-size 2 with launched ranks: a launched job runs its rows at "
                                         r"its own size \(WORLD_SIZE=4\)"):
        check_launched_size(asked, "4")
    check_launched_size(resolve_settings({}, rank_mode=launched, env={}), "4")


def test_a_case_may_declare_its_world_sizes_per_row() -> None:
    spec = CaseSpec(id="a/b", world_size=lambda params: Scalable(default=2, minimum=2) if params["x"] else 2)
    assert (spec.needs_text({"x": True}), spec.needs_text({"x": False})) == ("cpu, ws >=2", "cpu, ws 2")
    with pytest.raises(ValueError, match=r"case a/b declares its world sizes per row; ask need_for\(params\)"):
        _ = spec.need
    with pytest.raises(ValueError, match="case a/b: world_size must be >= 1, got 0"):
        CaseSpec(id="a/b", world_size=lambda params: 0).need_for({})
