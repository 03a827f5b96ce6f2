"""The device plan's decisions, from given GPU counts (no GPU is needed or faked), and the CPU placement."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import harness
from harness.ranks import devices
from harness.ranks.cpu_budget import concurrent_workers, intra_op_threads
from harness.ranks.devices import ANY_GPU, GpuNeed, decide, distinct_gpus

pytest_plugins = ["pytester"]

TWO_DISTINCT = distinct_gpus(2)


@pytest.mark.parametrize(
    ("setting", "gpus", "world_size", "need", "placement", "reason"),
    [
        # CPU rows run under cpu whatever the machine and the setting.
        ("auto", 0, 2, None, "cpu", ""),
        ("auto", 8, 2, None, "cpu", ""),
        ("cuda", 8, 1, None, "cpu", ""),
        ("cpu", 8, 4, None, "cpu", ""),
        # No GPU: GPU rows skip with the need and what was found.
        ("auto", 0, 2, ANY_GPU, None, "needs any GPU, found 0"),
        ("auto", 0, 2, TWO_DISTINCT, None, "needs 2 distinct GPUs, found 0"),
        # One GPU: ranks share it, unless the row needs distinct GPUs; world size 1 gets it alone.
        ("auto", 1, 2, ANY_GPU, "cuda-shared", ""),
        ("auto", 1, 4, ANY_GPU, "cuda-shared", ""),
        ("auto", 1, 1, ANY_GPU, "cuda", ""),
        ("auto", 1, 2, TWO_DISTINCT, None, "needs 2 distinct GPUs, found 1"),
        # Two GPUs: one per rank at ws 2, shared at ws 4.
        ("auto", 2, 2, ANY_GPU, "cuda", ""),
        ("auto", 2, 2, TWO_DISTINCT, "cuda", ""),
        ("auto", 2, 4, ANY_GPU, "cuda-shared", ""),
        ("auto", 2, 4, TWO_DISTINCT, "cuda-shared", ""),
        # Eight GPUs: one per rank.
        ("auto", 8, 4, ANY_GPU, "cuda", ""),
        ("cuda", 8, 8, TWO_DISTINCT, "cuda", ""),
        # --device cpu: GPU rows never run, whatever the machine has.
        ("cpu", 8, 2, ANY_GPU, None, "needs any GPU; the device setting is cpu"),
    ],
)
def test_plan(setting: str, gpus: int, world_size: int, need: GpuNeed | None, placement: str | None,
              reason: str) -> None:
    decision = decide(setting=setting, gpus=gpus, world_size=world_size, need=need)
    assert (decision.placement, decision.reason) == (placement, reason)


def test_without_nccl_a_gpu_per_rank_still_shares_over_gloo() -> None:
    assert decide(setting="auto", gpus=2, world_size=2, need=ANY_GPU, nccl=False).placement == "cuda-shared"


def test_rank_devices_and_backends() -> None:
    assert [str(devices.rank_device("cuda-shared", r, 1)) for r in range(4)] == ["cuda:0"] * 4
    assert [str(devices.rank_device("cuda-shared", r, 2)) for r in range(4)] == ["cuda:0", "cuda:1"] * 2
    assert [str(devices.rank_device("cuda", r, 8)) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert str(devices.rank_device("cpu", 3, 8)) == "cpu"
    # A GPU group also moves CPU tensors, world size 1 included; shared GPUs go over gloo.
    assert devices.process_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert devices.process_backend("cuda-shared") == devices.process_backend("cpu") == "gloo"


def test_a_launched_job_uses_nccl_only_with_a_gpu_per_local_rank() -> None:
    from harness.ranks.launched import job_backend

    assert job_backend(2, 2, True) == job_backend(4, 8, True) == "cpu:gloo,cuda:nccl"
    assert job_backend(2, 1, True) == job_backend(2, 0, True) == job_backend(2, 2, False) == "gloo"


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda: decide(setting="gpu", gpus=0, world_size=2, need=None), ValueError, "got 'gpu'"),
        (lambda: devices.check_setting("gpu", "FSDP_DEVICE", 0), ValueError, r"FSDP_DEVICE='gpu': expected one of"),
        (lambda: devices.check_setting("cuda", "--device", 0), ValueError, "--device=cuda, but no CUDA device"),
        (lambda: devices.check_placement("cuda", 2, 1, True), RuntimeError, "needs one GPU per rank \\(2\\)"),
        (lambda: devices.check_placement("cuda-shared", 2, 0, True), RuntimeError, "at least one GPU, found 0"),
        (lambda: GpuNeed(0), ValueError, "GpuNeed.distinct must be an int >= 1, got 0"),
    ],
)
def test_bad_values_are_named(call, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize(
    ("cores", "world_size", "workers", "threads"),
    [(2, 2, 1, 1), (2, 4, 1, 1), (16, 2, 1, 8), (16, 4, 2, 2), (16, 1, 1, 16), (16, 8, 4, 1), (1, 1, 1, 1)],
)
def test_intra_op_threads_share_the_cores(cores: int, world_size: int, workers: int, threads: int) -> None:
    assert intra_op_threads(world_size, workers=workers, cores=cores) == threads


def test_worker_count_comes_from_the_environment_with_its_source_named() -> None:
    assert concurrent_workers({}) == 1
    assert concurrent_workers({"PYTEST_XDIST_WORKER_COUNT": "3"}) == 3
    assert concurrent_workers({"FSDP_CONCURRENT_WORKERS": "2", "PYTEST_XDIST_WORKER_COUNT": "3"}) == 2
    with pytest.raises(ValueError, match="FSDP_CONCURRENT_WORKERS='many': expected a whole number >= 1"):
        concurrent_workers({"FSDP_CONCURRENT_WORKERS": "many"})


def _what_the_rank_sees(ctx: harness.RankContext) -> tuple[str | None, bool, str, int]:
    return (os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available(), str(ctx.device),
            torch.get_num_threads())


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_cpu_placement_hides_cuda_and_sets_threads(mode: str) -> None:
    seen = harness.run(_what_the_rank_sees, world_size=2, mode=mode)
    assert seen == [("", False, "cpu", intra_op_threads(2))] * 2


_PRELOAD_PROBE = """
import torch
calls = []
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device"):
    real = getattr(torch.cuda, name)
    setattr(torch.cuda, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
import importlib
from harness.ranks.process import PRELOAD
for module in PRELOAD:
    importlib.import_module(module)
print(calls)
"""


def test_the_forkserver_preload_never_probes_cuda() -> None:
    """The forkserver forks every rank; a CUDA probe there would defeat hiding CUDA in the ranks."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_PRELOAD_PROBE)], capture_output=True, text=True,
                         check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


PLACING_PLUGIN = '''
def pytest_ranks_placement(item):
    return "nowhere" if "placed" in item.name else None
'''

PLACED_BODIES = '''
import os, pytest

@pytest.mark.ranks(world_size=1, modes=("thread",))
def test_placed(ctx):
    pass

@pytest.mark.ranks(world_size=1, modes=("thread",))
def test_default(ctx):
    assert str(ctx.device) == "cpu" and os.environ["CUDA_VISIBLE_DEVICES"] == ""
'''


@pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]
def test_a_plugin_places_ranks_tests_through_the_hook(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PLACING_PLUGIN)
    pytester.makepyfile(test_bodies=PLACED_BODIES)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", "conformance.pytest_plugin")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*placement must be one of ('cpu', 'cuda', 'cuda-shared'), got 'nowhere'*"])
