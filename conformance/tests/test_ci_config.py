"""The workflow files are valid YAML and run tox environments that exist."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def _tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return parser


def _tox_envs() -> set[str]:
    envs = {section.split(":", 1)[1] for section in _tox().sections() if section.startswith("testenv:")}
    return envs | {"py"}


def test_tox_declares_the_documented_environments() -> None:
    assert {"py", "torch214", "conformance", "gpu", "lint"} <= _tox_envs()


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_runs_only_real_tox_envs(path: Path) -> None:
    workflow = yaml.safe_load(path.read_text())
    runs = [step.get("run", "") for job in workflow["jobs"].values() for step in job["steps"]]
    used = {m for run in runs for m in re.findall(r"tox -e (\w+)", run)}
    assert used, f"{path.name} runs no tox environment"
    assert used <= _tox_envs(), f"{path.name} uses unknown tox envs {used - _tox_envs()}"


def test_nightly_gpu_is_scheduled_on_a_gpu_runner_and_uploads_reports() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "nightly-gpu.yml").read_text())
    # PyYAML reads the key "on" as the boolean True.
    triggers = workflow.get("on", workflow.get(True))
    assert triggers["schedule"][0]["cron"]
    job = workflow["jobs"]["gpu-conformance"]
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in job["steps"])


def test_gpu_check_fails_loudly_without_enough_devices() -> None:
    import torch

    from conformance.runner.gpu_check import check

    problem = check(min_devices=torch.cuda.device_count() + 1)
    assert problem is not None and ("needs" in problem or "no CUDA device" in problem)


def test_gpu_env_checks_devices_then_runs_gpu_mutants_and_the_matrix() -> None:
    commands = [line.strip() for line in _tox()["testenv:gpu"]["commands"].splitlines() if line.strip()]
    assert commands[0].startswith("python -m conformance.runner.gpu_check"), commands
    assert "pytest --nightly conformance/tests/selftest/test_mutants.py -m gpu" in commands, commands
    assert commands[0] == "python -m conformance.runner.gpu_check --min-devices 1", "one GPU is enough (cuda-shared)"
    matrix = next(line for line in commands if line.startswith("fsdp-conformance run --impl all"))
    assert "--device cuda" in matrix and "-m gpu" in commands[commands.index(matrix) + 3], commands


def test_ci_runs_the_tests_on_every_claimed_torch() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    claimed = re.search(r'CI_TORCH_VERSIONS:-([0-9. ]+)\}', script)
    assert claimed is not None, "the torch versions .ci/run tests are not declared"
    tox_torches = {m for m in re.findall(r"torch==([0-9.]+)", (ROOT / "tox.ini").read_text())}
    assert set(claimed.group(1).split()) == tox_torches == {"2.13.0", "2.14.1"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)"', pyproject)
    assert floor is not None and min(tox_torches).startswith(floor.group(1)), "the torch floor must be tested"


def test_gpu_rows_carry_the_gpu_mark() -> None:
    from conformance.contract.case import ANY_GPU, case

    @case("area/gpu_row", gpus=ANY_GPU)
    def test_gpu_row(ctx: object, impl: object) -> None: ...

    @case("area/cpu_row")
    def test_cpu_row(ctx: object, impl: object) -> None: ...

    assert "gpu" in {m.name for m in test_gpu_row.pytestmark}  # type: ignore[attr-defined]
    assert "gpu" not in {m.name for m in test_cpu_row.pytestmark}  # type: ignore[attr-defined]


def test_ci_installs_chromium_and_checks_the_main_jobs_html_report() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert "apt-get install -y -qq chromium" in script
    main_job = script.index("fsdp-conformance\" run -n auto")
    assert "--html reports/conformance.html" in script[main_job:]
    assert script.index("-m conformance.runner.html_check reports/conformance.html") > main_job
