"""The pytest plugin, driven through real pytest runs (pytester, in-process: [Note: in-process sessions])."""

from __future__ import annotations

import pytest

from harness.tests.inprocess import pytester_run

pytest_plugins = ["pytester", "harness.tests.inprocess"]
pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

BODIES = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.ranks(world_size=2)
def test_sum(ctx):
    t = torch.ones(1) * (ctx.rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3.0

@pytest.mark.ranks(world_size=2, modes=("thread",))
@pytest.mark.parametrize("scale", [1, 2])
def test_param(ctx, scale, tmp_path):
    assert scale in (1, 2) and tmp_path.exists()

@pytest.mark.ranks(world_size=2)
def test_fails_on_rank_1(ctx):
    assert ctx.rank != 1, "rank one disagrees"

@pytest.mark.ranks(world_size=2)
def test_skips(ctx):
    pytest.skip("no accelerator here")

@pytest.mark.ranks(world_size=2)
def test_partial_skip(ctx):
    if ctx.rank == 0:
        pytest.skip("only rank 0 skips")
'''


@pytest.fixture
def suite(preloaded: None, pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_bodies=BODIES)
    return pytester


def test_outcomes_in_both_modes(suite: pytest.Pytester) -> None:
    result = pytester_run(suite, "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=4, skipped=2)
    result.stdout.fnmatch_lines([
        "*_ test_fails_on_rank_1?process? _*",
        "rank 1 raised AssertionError: rank one disagrees (world_size=2, mode=process)",
        "*_ test_partial_skip?thread? _*",
        "rank 0 skipped: Skipped: only rank 0 skips (ranks [[]1[]] did not skip) (world_size=2, mode=thread)",
    ])


def test_rank_mode_option_selects_modes(suite: pytest.Pytester) -> None:
    result = pytester_run(suite, "-q", "-p", "no:cacheprovider", "--fsdp-rank-mode", "thread", "-k", "sum or param")
    result.assert_outcomes(passed=3)
    result.stdout.no_fnmatch_line("*process*")


def test_bad_rank_mode_names_its_source(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_RANK_MODE", "both-ish")
    result = pytester_run(suite, "-q", "-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["*FSDP_RANK_MODE='both-ish': expected one of both, process, thread, launched*"])
    assert result.ret != 0


def test_timeout_mark_is_added_from_the_marker(suite: pytest.Pytester) -> None:
    result = pytester_run(suite, "-q", "-p", "no:cacheprovider", "--collect-only", "-k", "test_sum")
    result.stdout.fnmatch_lines(["*test_sum?process?*", "*test_sum?thread?*"])
    from harness.plugin.pytest_plugin import POOL_START_MARGIN_S

    assert POOL_START_MARGIN_S > 0
