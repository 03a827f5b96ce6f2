"""The project's own tests do not depend on which other adapters the environment installs.

docs/ADAPTER_GUIDE.md tells adapter authors to install their package, with its
``fsdp_conformance.adapters`` entry point, into the same environment; the
registry then lists it (and ``all`` may include it). The tests about the
built-in adapters must still pass there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import conformance
from conformance.runner import cli
from conformance.tests.installed import fake_distribution
from harness.tests.inprocess import run_main

PROJECT = Path(conformance.__file__).resolve().parents[1]


def test_declarations_pass_with_a_third_party_adapter_installed(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake_distribution(tmp_path, "third-party-fsdp", "0.1",
                      "[fsdp_conformance.adapters]\nthird-party = third_party_fsdp:Adapter\n")
    for name in [name for name in os.environ if name.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    monkeypatch.syspath_prepend(tmp_path)  # as if installed: its dist-info's entry point registers it
    monkeypatch.chdir(tmp_path)
    listed = run_main(cli.main, "impls")
    assert "third-party" in listed.stdout, "the fake distribution must be visible, or this test proves nothing"
    run = run_main(pytest.main, "-q", "-p", "no:cacheprovider", "-p", "conformance.pytest_plugin",
                   str(PROJECT / "conformance" / "tests" / "contract" / "test_declarations.py"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
