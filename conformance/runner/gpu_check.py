"""Fail loudly when a GPU job finds no GPU, instead of skipping every GPU row.

``python -m conformance.runner.gpu_check --min-devices 2`` exits non-zero naming what
it found; the nightly GPU job runs it before the matrix.
"""

from __future__ import annotations

import argparse
import sys

import torch

__all__ = ["check"]


def check(min_devices: int) -> str | None:
    """``None`` when at least ``min_devices`` CUDA devices are usable, else why not."""
    if not torch.cuda.is_available():
        return f"no CUDA device is visible (torch {torch.__version__}, cuda build {torch.version.cuda})"
    found = torch.cuda.device_count()
    if found < min_devices:
        return f"needs {min_devices} CUDA devices, found {found}"
    if not torch.distributed.is_nccl_available():
        return "torch.distributed has no NCCL backend in this build"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-devices", type=int, default=1)
    problem = check(parser.parse_args().min_devices)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 1
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"gpu_check: {len(names)} device(s): {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
