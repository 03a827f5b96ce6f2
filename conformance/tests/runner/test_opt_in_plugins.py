"""Installing the suite leaves other projects' pytest runs alone ([Note: opt-in plugins]).

A scratch project with one one-line test, run by ``python -m pytest`` in this
environment (where the suite is installed): nothing of the suite and not torch
is imported, nothing is warned, and the project's own ``--device`` option
works. Asked for with ``-p conformance.pytest_plugin``, the suite's options
are there beside the project's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

#: The suite's top-level packages, and torch.
GUESTS = ("conformance", "harness", "fsdp_impl", "fixtures", "torch")
#: The scratch project's test: one line, failing if a guest was imported.
TEST = ("def test_alone(): import sys; assert not any(m.split('.')[0] in " + repr(GUESTS) + " for m in sys.modules)\n")
#: A conftest with an option that ML projects often define, and a check that its value arrives.
CONFTEST = """\
def pytest_addoption(parser):
    parser.addoption("--device", default="cpu")


def pytest_configure(config):
    assert config.getoption("--device") == "meta", config.getoption("--device")
"""


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` in ``project``, as its owner runs it: none of this session's pytest settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "test_alone.py").write_text(TEST)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    return tmp_path


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"^ {2}(--[\w-]+)", help_text, flags=re.MULTILINE))


def test_an_unrelated_project_imports_nothing_of_the_suite_and_warns_nothing(project: Path) -> None:
    import conformance

    assert Path(conformance.__file__).resolve().parents[1] != project, "the suite must not be the project"
    run = _pytest(project, "--device", "meta", "-p", "no:cacheprovider")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "1 passed" in output, output
    assert "warning" not in output.lower(), output


def test_asked_for_the_suite_loads_beside_the_project_options_all_namespaced(project: Path) -> None:
    alone = _options(_pytest(project, "--device", "meta", "--help").stdout)
    run = _pytest(project, "-p", "conformance.pytest_plugin", "--device", "meta", "--help")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert not re.search(r"[A-Z]\w*Warning", output), output
    added = _options(run.stdout) - alone
    assert {"--fsdp-device", "--fsdp-impl", "--fsdp-rank-mode", "--conformance-json"} <= added, sorted(added)
    assert "--device" in alone and "--device" in _options(run.stdout)
    unspaced = sorted(name for name in added if not name.startswith(("--fsdp-", "--conformance-")))
    assert not unspaced, f"options of the suite outside its namespaces: {unspaced}"
