"""``fsdp-conformance list --impl NAME`` previews what ``run`` reports for each row, including an adapter that fails."""

from __future__ import annotations

import inspect
import os

import pytest

from conformance.runner.cli import main
from harness.tests.inprocess import run_main

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]


def test_an_adapter_that_fails_to_import_is_previewed_as_error_like_run_reports_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FSDP_CONFORMANCE_ADAPTERS", "broken=no_such_module:Nope")
    listed = run_main(main, "list", "--impl", "broken", "-k", "exec_order and train_eval")
    assert listed.returncode == 0, listed.stderr
    rows = listed.stdout.splitlines()[:-1]
    assert len(rows) == 2
    expected = "; error (process/thread): adapter 'broken' failed to load: ModuleNotFoundError: No module named"
    assert all(expected in row and "n/a" not in row for row in rows), listed.stdout
    assert listed.stdout.splitlines()[-1] == ("2 cases; 0 with n/a rank modes for broken; 2 that would be errors "
                                              "(the adapter fails to load)")


def test_explain_prints_what_a_row_asserts_and_refuses_an_unknown_row(capsys: pytest.CaptureFixture[str]) -> None:
    from conformance.cases.test_placement import test_no_params

    assert main(["list", "--explain", "placement/no_params[use_device_id=True]", "-k", "no_params"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("placement/no_params[use_device_id=True]\n  cpu, ws >=2; modes process/thread")
    assert "requires compute_device" in out
    assert " ".join(inspect.cleandoc(test_no_params.__doc__ or "").split()) in " ".join(out.split())
    assert main(["list", "--explain", "placement/no_params[use_device_id=maybe]", "-k", "no_params"]) == 2
    assert "no row 'placement/no_params[use_device_id=maybe]'" in capsys.readouterr().err
