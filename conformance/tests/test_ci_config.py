"""The workflow files are valid YAML and run tox environments that exist."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

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
    assert {"py", "conformance", "gpu", "lint"} <= _tox_envs()


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

    from conformance.gpu_check import check

    problem = check(min_devices=torch.cuda.device_count() + 1)
    assert problem is not None and ("needs" in problem or "no CUDA device" in problem)


def test_gpu_env_checks_devices_then_runs_gpu_mutants_and_the_matrix() -> None:
    commands = [line.strip() for line in _tox()["testenv:gpu"]["commands"].splitlines() if line.strip()]
    assert commands[0].startswith("python -m conformance.gpu_check"), commands
    assert "pytest conformance/tests/test_mutants.py -m gpu" in commands, commands
    assert any(line.startswith("fsdp-conformance run --impl all") for line in commands), commands
