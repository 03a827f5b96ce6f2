"""Every case module imports without probing CUDA, so the rank processes' forkserver preloads it
([Note: preloaded task modules] in ``harness/ranks/process.py``) instead of each rank importing it again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from conformance.selftest.session import CASES_DIR

_IMPORT_BEHIND_THE_FENCE = """
import importlib, sys
from harness.ranks.process import PRELOAD
for name in PRELOAD:
    importlib.import_module(name)
from harness.ranks._preload_begin import CudaProbeRefused
refused = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except CudaProbeRefused as exc:
        refused.append(f"{name}: {exc}")
import harness.ranks._preload_end
print(refused)
"""


@pytest.mark.skipif(not hasattr(torch._C, "_cuda_getDeviceCount"),
                    reason="a CPU build of torch has no CUDA probe to refuse, so every module passes")
def test_no_case_module_probes_cuda_as_it_is_imported() -> None:
    modules = sorted(f"conformance.cases.{path.stem}" for path in CASES_DIR.glob("test_*.py"))
    assert len(modules) > 20, modules
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_IMPORT_BEHIND_THE_FENCE), *modules],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-3000:]
